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

When ``/dev/shm`` has no room (a small container default, or a full one), a segment that
fails is removed at once and the bytes go through the socket as an ordinary out-of-band
frame; this is said once per process (``SharedMemoryFull``), and shared memory is used again
as soon as there is room.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import shutil
import sys
import threading
import warnings
import weakref
from types import FrameType

SHM_MIN = 1 << 20  # smaller buffers go through the socket
ROOT = "/dev/shm"
POOL_BYTES = 1 << 30  # warm segments kept for reuse, at most
# What a full (or inode-less) tmpfs answers to a create or a write.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG}
_said_full = False
_tracking = threading.local()  # .store: the Segments collecting this thread's pickled arguments, if any


class SharedMemoryFull(RuntimeWarning):
    """Large arguments travel through the socket because ``/dev/shm`` has no room for them."""


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
        _tracking.store = self
        try:
            yield created
        except BaseException:
            self.unlink(created)  # pickling failed: no call will ever release them
            raise
        finally:
            self._local.created = None
            _tracking.store = None

    def tracking(self) -> bool:
        return getattr(self._local, "created", None) is not None


    def _take(self, nbytes: int) -> tuple[int, str] | None:
        """A pooled segment of at least ``nbytes`` and at most twice that, or None."""
        with self._pool_lock:
            fits = [(entry[0], i) for i, entry in enumerate(self._pool) if nbytes <= entry[0] <= 2 * nbytes]
            if not fits:
                return None
            return self._pool.pop(min(fits)[1])

    def write(self, buf: memoryview) -> str | None:
        """Copy ``buf`` into a segment and return its path; None when ``/dev/shm`` has no
        room for it, and the caller sends the bytes through the socket instead."""
        view = buf.cast("B")
        pooled = self._take(view.nbytes)
        if pooled is None and not self._room_for(view.nbytes):
            return None
        try:
            path = self._write(view, pooled)
        except OSError as e:
            if e.errno not in _FULL:
                raise
            _say_full(view.nbytes, f"writing the segment failed: {e.strerror}")
            return None
        self._local.created.append(path)
        return path

    def _room_for(self, nbytes: int) -> bool:
        """Whether a new segment of ``nbytes`` fits, giving back warm segments if that helps."""
        free = free_bytes()
        if free >= nbytes:
            return True
        if self._pool:
            self.trim()
            free = free_bytes()
            if free >= nbytes:
                return True
        _say_full(nbytes, f"it has {free / (1 << 20):.1f} MiB free")
        return False

    def _write(self, view: memoryview, pooled: tuple[int, str] | None) -> str:
        """The path of a segment now holding ``view``; a segment that fails is removed."""
        if pooled is not None:
            path = pooled[1]
            mm = self._maps.get(path)
            if mm is not None and view.nbytes and not view.readonly:
                # Pages and page tables exist: a plain memcpy, without the GIL.
                ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(mm)),
                               ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes)
                return path
            fd = os.open(path, os.O_WRONLY)
        else:
            self._ensure_dir()
            path = os.path.join(self.dir, secrets.token_hex(8))
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            # write(), not a mapping: the kernel fills fresh tmpfs pages without a page
            # fault per 4 KiB, which is most of the cost of a large segment.
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], done)
        except BaseException:
            self.unlink([path])  # half a segment is of no use to anyone, and holds pages
            raise
        finally:
            os.close(fd)
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


def free_bytes() -> int:
    """Bytes a new segment may take in ``/dev/shm`` now; 0 where it cannot be asked."""
    try:
        st = os.statvfs(ROOT)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _say_full(nbytes: int, why: str) -> None:
    """Once per process: large arguments now go through the socket."""
    global _said_full
    if _said_full:
        return
    _said_full = True
    warnings.warn(
        f"{ROOT} has no room for a {nbytes / (1 << 20):.1f} MiB argument ({why}): large "
        "arguments to ranks on this host go through the socket instead (one more copy each) "
        f"until it has room again. Free space in {ROOT}, or give it more (docker run "
        "--shm-size=8g, or mount -o remount,size=8G /dev/shm)",
        SharedMemoryFull, stacklevel=_caller_level())


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PICKLERS = {"pickle.py", "cloudpickle.py", "cloudpickle_fast.py"}


def _caller_level() -> int:
    """The stacklevel, seen from ``_say_full``, of the first frame outside this package and
    the picklers: the user's call that carried the argument."""
    frame: FrameType | None = sys._getframe(1)  # _say_full
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or os.path.basename(frame.f_code.co_filename) in _PICKLERS):
        frame, level = frame.f_back, level + 1
    return level


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


def tracking() -> Segments | None:
    """The segments collecting what the calling thread pickles now (inside ``Segments.track``),
    or None: large arrays then go through the socket."""
    return getattr(_tracking, "store", None)
