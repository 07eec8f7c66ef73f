"""Shared-memory segments for large arrays and tensors sent to ranks on the same host.

The sender copies the bytes once into a file under ``/dev/shm``; each receiving rank maps
it copy-on-write (its own writes stay private) instead of receiving the bytes through a
socket.  The sender unlinks a call's segments when every rank has answered, by which time
each rank has mapped what it needed; the template removes the whole directory if the
controller dies first.  Never used across hosts.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import threading

SHM_MIN = 1 << 20  # smaller buffers go through the socket
ROOT = "/dev/shm"


def available() -> bool:
    return os.path.isdir(ROOT) and os.access(ROOT, os.W_OK)


class Segments:
    """The segments this process created, grouped by the call they belong to."""

    def __init__(self):
        self.dir = os.path.join(ROOT, f"mk-{os.getpid()}-{secrets.token_hex(4)}")
        self._made = False
        self._local = threading.local()

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

    def write(self, buf: memoryview) -> str:
        self._ensure_dir()
        path = os.path.join(self.dir, secrets.token_hex(8))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            # write(), not a mapping: the kernel fills fresh tmpfs pages without a page
            # fault per 4 KiB, which is most of the cost of a large segment.
            view, done = buf.cast("B"), 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)
        self._local.created.append(path)
        return path

    @staticmethod
    def unlink(paths) -> None:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def map_private(path: str, nbytes: int) -> memoryview:
    """Map a segment copy-on-write: reads share the sender's pages, writes stay private."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return memoryview(mm)
