"""Shared-memory segments for large arrays and tensors sent to ranks on the same host.

The sender copies the bytes once into a file under ``/dev/shm``; each receiving rank maps
it copy-on-write (its own writes stay private) instead of receiving the bytes through a
socket.  When every rank has answered, each has mapped what it needed; the template removes
the whole directory if the controller dies first.  Never used across hosts.

Filling fresh tmpfs pages costs far more than copying into pages that exist, so a finished
call's segments are kept for reuse when no rank still maps them, mapped once in the sender:
a reuse is then a plain memcpy (pwrite into existing pages runs at about half of that).  A rank holds a shared
``flock`` on a segment for as long as its mapping lives (an argument it keeps, or a view of
one); the sender reuses a segment only if it can take the lock exclusively, and unlinks it
otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import shutil
import threading
import weakref

SHM_MIN = 1 << 20  # smaller buffers go through the socket
ROOT = "/dev/shm"
POOL_BYTES = 1 << 30  # warm segments kept for reuse, at most


def available() -> bool:
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK)


class Segments:
    """The segments this process created, grouped by the call they belong to."""

    def __init__(self):
        self.dir = os.path.join(ROOT, f"mk-{os.getpid()}-{secrets.token_hex(4)}")
        self._made = False
        self._local = threading.local()
        self._pool: list[tuple[int, str]] = []  # (bytes, path) of free warm segments, oldest first
        self._maps: dict[str, mmap.mmap] = {}  # our writable mapping of each segment kept for reuse
        self._pool_lock = threading.Lock()

    def _ensure_dir(self) -> None:
        if not self._made:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._made = True

    @contextlib.contextmanager
    def track(self):
        """Collect the paths of segments written while pickling one call's arguments."""
        created: list[str] = []
        self._local.created = created
        try:
            yield created
        finally:
            self._local.created = None

    def tracking(self) -> bool:
        return getattr(self._local, "created", None) is not None

    def _take(self, nbytes: int) -> tuple[int, str] | None:
        """A pooled segment of at least ``nbytes`` and at most twice that, or None."""
        with self._pool_lock:
            fits = [(entry[0], i) for i, entry in enumerate(self._pool) if nbytes <= entry[0] <= 2 * nbytes]
            if not fits:
                return None
            return self._pool.pop(min(fits)[1])

    def write(self, buf: memoryview) -> str:
        self._ensure_dir()
        pooled = self._take(buf.nbytes)
        view = buf.cast("B")
        if pooled is not None:
            path = pooled[1]
            mm = self._maps.get(path)
            if mm is not None and view.nbytes and not view.readonly:
                # Pages and page tables exist: a plain memcpy, without the GIL.
                ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(mm)),
                               ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes)
                self._local.created.append(path)
                return path
            fd = os.open(path, os.O_WRONLY)
        else:
            path = os.path.join(self.dir, secrets.token_hex(8))
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            # write(), not a mapping: the kernel fills fresh tmpfs pages without a page
            # fault per 4 KiB, which is most of the cost of a large segment.
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)
        self._local.created.append(path)
        return path

    def unlink(self, paths) -> None:
        for p in paths:
            mm = self._maps.pop(p, None)
            if mm is not None:
                mm.close()
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def release(self, paths, reuse: bool) -> None:
        """A call is over: keep its segments that no rank maps any more, unlink the rest."""
        gone = []
        for p in paths:
            if not reuse:
                gone.append(p)
                continue
            try:
                fd = os.open(p, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a rank maps it
                size = os.fstat(fd).st_size
                if p not in self._maps and size:
                    # Once per segment: later reuses copy into these mapped pages.
                    self._maps[p] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                gone.append(p)
                continue
            finally:
                os.close(fd)
            with self._pool_lock:
                self._pool.append((size, p))
                while sum(e[0] for e in self._pool) > POOL_BYTES:
                    gone.append(self._pool.pop(0)[1])
        self.unlink(gone)

    def trim(self) -> None:
        """Give the pooled segments' memory back."""
        with self._pool_lock:
            pooled, self._pool = self._pool, []
        self.unlink(p for _s, p in pooled)

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def map_private(path: str, nbytes: int) -> memoryview:
    """Map a segment copy-on-write: reads share the sender's pages, writes stay private.

    The shared lock lasts as long as the mapping, telling the sender not to reuse the file.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)
    return memoryview(mm)
