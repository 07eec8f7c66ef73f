"""Whether a buffer is still registered, told through shared memory instead of a round trip:
the owner keeps one word per buffer in a page peers on its host map (a ``memfd``, never a
name in ``/dev/shm``); a reader that sees its buffer's word and an idle connection to a live
owner copies at once.  It must never answer "live" for a word it cannot vouch for: anything
but the buffer's own id sends the reader to the owner (``CHECK``), which says exactly why.
"""

from __future__ import annotations

import atexit
import mmap
import os
import socket
import struct
import threading

# Slot ``id % SLOTS`` holds ``id`` while buffer ``id`` is registered and 0 once dropped; a
# later buffer that lands on the same slot overwrites it, and the earlier one then asks its
# owner (correct, one round trip slower).  The owner writes the word before it answers the
# DROP request, so a drop that has returned is seen by every later read on this host (x86
# and ARM both make an aligned 8-byte store visible whole).
SLOTS = 1 << 16
WORD = struct.Struct("<Q")


class Words:
    """The owner's page of words (``SLOTS`` of them, sparse: untouched pages cost nothing)."""

    def __init__(self):
        self.fd = os.memfd_create("mk-data-live", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, SLOTS * WORD.size)
        self._mm = mmap.mmap(self.fd, SLOTS * WORD.size)

    def set(self, bid: int) -> None:
        WORD.pack_into(self._mm, (bid % SLOTS) * WORD.size, bid)

    def clear(self, bid: int) -> None:
        if WORD.unpack_from(self._mm, (bid % SLOTS) * WORD.size)[0] == bid:
            WORD.pack_into(self._mm, (bid % SLOTS) * WORD.size, 0)


class Watch:
    """A reader's view of one owner: its words, and a connection kept idle whose end of file
    says the owner has gone (a killed owner's socket is readable at once)."""

    def __init__(self, fd: int, sock: socket.socket):
        try:
            self._mm = mmap.mmap(fd, SLOTS * WORD.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.sock = sock
        sock.setblocking(False)  # live() peeks, never waits

    def live(self, bid: int) -> bool:
        """True only while buffer ``bid`` is registered and its owner's connection is quiet."""
        if WORD.unpack_from(self._mm, (bid % SLOTS) * WORD.size)[0] != bid:
            return False
        try:  # one syscall, safe from any thread: nothing to read while the owner lives
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # end of file (the owner is gone), or bytes nobody asked for

    def close(self) -> None:
        self.sock.close()
        try:
            self._mm.close()
        except BufferError:
            pass


_watches: dict[bytes, Watch] = {}  # owner instance -> its watch
_lock = threading.Lock()
_close_at_exit = [False]  # whether close_all() is registered (at the first watch kept)


def close_all() -> None:
    """Close every watch (at exit: a socket left to the GC warns)."""
    with _lock:
        watches = list(_watches.values())
        _watches.clear()
    for w in watches:
        w.close()


def watch(instance: bytes) -> Watch | None:
    with _lock:
        return _watches.get(instance)


def keep(instance: bytes, fd: int, sock: socket.socket) -> Watch:
    """Keep ``sock`` (handshaken, never used for requests again) and the words ``fd``."""
    w = Watch(fd, sock)
    with _lock:
        old = _watches.get(instance)
        if old is None:
            _watches[instance] = w
            if not _close_at_exit[0]:
                _close_at_exit[0] = True
                atexit.register(close_all)
            return w
    w.close()  # another thread got there first
    return old


def forget(instance: bytes) -> None:
    with _lock:
        w = _watches.pop(instance, None)
    if w is not None:
        w.close()


_none: set[bytes] = set()  # owners that gave no words (older, or over TCP): always CHECK


def obtain(h, key: bytes, timeout: float | None) -> Watch | None:
    """The watch on ``h``'s owner, asked for once (a connection of its own, kept idle).
    None where it cannot be had now: the transfer that asks has already succeeded, and the
    next one asks its owner instead (and tries again)."""
    from . import client, wire
    from .errors import TransferError

    w = watch(h.instance)
    if w is not None or h.instance in _none:
        return w
    try:
        sock = client.Connection(h, "unix", key, timeout).detach()
    except (OSError, TransferError):
        return None
    try:
        status, _msg, fds = client.request_fds(sock, h, wire.Op.LIVE)
    except OSError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    if status != wire.Status.OK or not fds:
        for fd in fds:
            os.close(fd)
        sock.close()
        _none.add(h.instance)
        return None
    for fd in fds[1:]:
        os.close(fd)
    return keep(h.instance, fds[0], sock)
