"""The ``shm`` transport: one copy between two processes on one host, owner half and reader
half.  It must never leave a name in ``/dev/shm`` (segments are unlinked at once) nor let a
peer touch memory before the owner has checked its token and range.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import mmap
import os
import re
import socket
import sys
import threading

from ..runtime import segments
from . import client, liveness, tcp, wire
from .errors import BufferDropped, ForgedHandle, OwnerGone
from .memory import Memory, copy

# The owner answers MAP with either a descriptor of the shared segment its memory lives in
# (mapped here once, then each transfer is a memcpy), or, for memory that could not move
# there (numpy arrays, bytearrays), its pid and the address, which this process reads or
# writes with process_vm_readv/writev: still one copy, straight between the two address
# spaces.  Where the kernel forbids that (ptrace rules), the bytes stream over the socket.


def is_available() -> tuple[bool, str]:
    if not segments.available():
        return False, f"{segments.ROOT} is missing or not writable"
    return True, ("peers on this host copy straight out of the owner's memory: torch CPU tensors "
                  "are moved into shared memory when registered; other memory streams over a "
                  "local socket")


# ---------------------------------------------------------------- owner side


def move_to_shared(mem: Memory) -> tuple[int, int, int] | None:
    """Move a CPU tensor's storage into shared memory, in place for every view of it.

    Returns ``(fd, storage bytes, byte offset of the tensor)``; the fd refers to an already
    unlinked segment, so nothing is left in ``/dev/shm`` whatever happens to the process.
    None for memory that cannot move (numpy arrays, bytearrays: their owner keeps the
    pointer), or that ``/dev/shm`` has no room for; peers then copy it out of the owner's
    memory or stream it over the local socket instead.
    """
    t = mem.tensor
    if t is None or mem.device != "cpu" or mem.nbytes == 0:
        return None
    torch = sys.modules["torch"]
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return None
    if not t.is_shared() and segments.free_bytes() < t.untyped_storage().nbytes():
        # torch would create a named /dev/shm/torch_* file, fail to allocate it, and leave it.
        return None
    try:
        t.share_memory_()
        storage = t.untyped_storage()
        fd, size = storage._share_fd_cpu_()
    except (RuntimeError, AttributeError) as e:
        _unlink_torch_leftover(str(e))
        return None
    # The storage moved: refresh the view onto its new address.
    mem.view = memoryview((ctypes.c_char * mem.nbytes).from_address(t.data_ptr())).cast("B")
    offset = t.data_ptr() - storage.data_ptr()
    return fd, size, offset


def _unlink_torch_leftover(message: str) -> None:
    """torch names the segment it failed to fill in its error ("... for file </torch_1_2_0>");
    it unlinks the name only after a successful mapping, so a failure leaves it behind."""
    m = re.search(r"<(/torch_\d+_[^>/]+)>", message)
    if m is not None and m.group(1).startswith(f"/torch_{os.getpid()}_"):
        try:
            os.unlink("/dev/shm" + m.group(1))
        except FileNotFoundError:
            pass


def allow_peers_to_read() -> None:
    """Under Yama's ptrace_scope=1, let peers on this host read registered memory directly
    (process_vm_readv); they still need the buffer's token from this server first."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass


def serve_map(sock: socket.socket, mem: Memory, shared: tuple[int, int, int] | None, via: str) -> None:
    """Answer a checked ``MAP`` of CPU memory: the segment's descriptor, or this process's pid
    and the address, or ``NOT_SHARED`` (over TCP, or read-only memory outside a segment)."""
    if via != "unix" or (shared is None and mem.readonly):
        wire.send_reply(sock, wire.Status.NOT_SHARED, b"not in shared memory")
    elif shared is not None:
        fd, size, base = shared
        msg = json.dumps({"size": size, "offset": base}).encode()
        socket.send_fds(sock, [wire.Reply(wire.Status.OK, msg).encode()], [fd])
    else:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mem.view)) if mem.nbytes else 0
        wire.send_reply(sock, wire.Status.OK, json.dumps({"pid": os.getpid(), "addr": addr}).encode())


# ---------------------------------------------------------------- reader side


class _Mapped:
    wrote = False  # a write through this mapping was checked by the owner once (not read-only)

    def __init__(self, mm: mmap.mmap, base: int):
        self.mm, self.base = mm, base
        self.window = memoryview(mm)

    def transfer(self, op: wire.Op, view: memoryview, offset: int, threads: int = 1) -> None:
        start = self.base + offset
        window = self.window[start:start + view.nbytes]
        if op == wire.Op.READ:
            copy(view, window, threads)
        else:
            copy(window, view, threads)

    def close(self) -> None:
        self.window.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a view of it is still alive; the mapping goes with it


class _CrossMemory:
    wrote = False

    def __init__(self, pid: int, addr: int):
        self.pid, self.addr = pid, addr

    def transfer(self, op: wire.Op, view: memoryview, offset: int, threads: int = 1) -> None:
        n = view.nbytes
        if n == 0:
            return
        local = _iovec(ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
        done = 0
        libc = _libc()
        fn = libc.process_vm_readv if op == wire.Op.READ else libc.process_vm_writev
        while done < n:
            loc = _iovec(local.base + done, n - done)
            rem = _iovec(self.addr + offset + done, n - done)
            got = fn(self.pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                if err == errno.ESRCH:
                    raise ConnectionResetError("the owner process has exited")
                raise _NoCrossMemory(err)
            done += got

    def close(self) -> None:
        pass


class _NoCrossMemory(Exception):
    pass


class _iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_size_t), ("len", ctypes.c_size_t)]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for f in (libc.process_vm_readv, libc.process_vm_writev):
        f.restype = ctypes.c_ssize_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return libc


_maps: dict[tuple, _Mapped | _CrossMemory] = {}  # (owner, buffer) -> how this process reaches it
_lock = threading.Lock()
_no_cma: set = set()  # owners whose memory this process may not access directly


def _mapping(h, sock: socket.socket) -> _Mapped | _CrossMemory | None:
    k = (h.instance, h.id, h.token)  # a handle with another token never rides this mapping
    with _lock:
        got = _maps.get(k)
    if got is not None:
        return got
    status, msg, fds = client.request_fds(sock, h, wire.Op.MAP)
    if status != wire.Status.OK:
        for fd in fds:
            socket.close(fd)
        if status == wire.Status.NOT_SHARED:
            return None
        client.raise_for(h, status, msg)
    info = json.loads(msg)
    if fds:
        try:
            mm = mmap.mmap(fds[0], info["size"], flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            for fd in fds:
                socket.close(fd)
        got = _Mapped(mm, info["offset"])
    else:
        got = _CrossMemory(info["pid"], info["addr"])
    with _lock:
        _maps[k] = got
    return got


def reached_by(h) -> str:
    """How this process reached ``h``'s memory last time: ``"_Mapped"``, ``"_CrossMemory"``
    or ``"socket"`` (never mapped)."""
    got = _maps.get((h.instance, h.id, h.token))
    return type(got).__name__ if got is not None else "socket"


def forget(h) -> None:
    """Unmap ``h``'s memory from this process (dropped, or its owner gone)."""
    with _lock:
        got = _maps.pop((h.instance, h.id, h.token), None)
    if got is not None:
        got.close()


def ready(h, op: wire.Op) -> bool:
    """Whether a transfer on ``h`` would be a bare copy now, with no round trip: mapped
    before (under this very token), the owner's word says registered, its connection quiet."""
    path = _maps.get((h.instance, h.id, h.token))
    if path is None or (op == wire.Op.WRITE and not path.wrote):
        return False
    w = liveness.watch(h.instance)
    return w is not None and w.live(h.id)


def transfer(h, key: bytes, op: wire.Op, view: memoryview, offset: int, timeout: float | None,
             threads: int = 1) -> None:
    """Copy straight between this process and the owner's memory, or stream over the Unix
    socket where that memory cannot be reached.  A buffer mapped before and still live
    (``ready``) is copied without asking its owner; otherwise the owner checks it first."""
    def fast() -> bool:
        path = _maps.get((h.instance, h.id, h.token))
        if path is None or not ready(h, op) or (view.readonly and isinstance(path, _CrossMemory)):
            return False
        try:
            path.transfer(op, view, offset, threads)
        except _NoCrossMemory:
            return False
        return True

    def run() -> bool:
        with client.Connection(h, "unix", key, timeout) as sock:
            path = None if h.instance in _no_cma and not h.shared else _mapping(h, sock)
            if path is None or (view.readonly and isinstance(path, _CrossMemory)):
                return False
            client.request(sock, h, wire.Op.CHECK, offset, view.nbytes)  # alive, not dropped, in range
            try:
                path.transfer(op, view, offset, threads)
            except _NoCrossMemory:
                _no_cma.add(h.instance)
                forget(h)
                return False
            path.wrote = path.wrote or op == wire.Op.WRITE  # the owner let this token write
        liveness.obtain(h, key, timeout)  # later transfers skip the CHECK
        return True

    try:
        if client.guarded(h, fast):
            return
        if not client.guarded(h, run):
            tcp.stream(h, key, "unix", op, view, offset, timeout)
    except (BufferDropped, OwnerGone, ForgedHandle):
        forget(h)
        liveness.forget(h.instance)
        raise
