"""The reader's side of the data plane: connections to owners, and one function per transport.

Connections are pooled per owner and transport; a transfer takes one for its whole duration,
so concurrent transfers from one process use separate sockets and run in parallel.  A
connection that fails is thrown away; the next transfer opens a new one.  An owner whose
server is busy with other handshakes turns a connection away; it is tried again shortly.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import socket
import threading
import time

from . import wire
from .server import NOT_SHARED
from .errors import BufferDropped, ForgedHandle, OwnerGone, TransferError

CONNECT_TIMEOUT_S = 2.0
BUSY_WAIT_S = 10.0  # how long to keep trying an owner whose server turns connections away

_pool: dict[tuple, list[socket.socket]] = {}
_maps: dict[tuple, tuple[mmap.mmap, int]] = {}
_lock = threading.Lock()


def _connect(h, via: str, key: bytes) -> socket.socket:
    deadline, pause = time.monotonic() + BUSY_WAIT_S, 0.005
    while True:
        sock = _open(h, via)
        try:
            wire.client_handshake(sock, key)
            return sock
        except wire.Busy:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise TransferError(
                    f"buffer {h.name!r}: the data server of {h.owner} turned every connection away "
                    f"for {BUSY_WAIT_S:.0f} s: too many connections to it are still proving the job "
                    "key (another process flooding it?); try again later") from None
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        except wire.HandshakeFailed as e:
            sock.close()
            raise TransferError(f"buffer {h.name!r}: {e}") from None
        except ConnectionError as e:
            sock.close()
            raise OwnerGone(h, f"the connection closed during the handshake ({e})") from None
        except BaseException:
            sock.close()
            raise


def _open(h, via: str) -> socket.socket:
    if via == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(h.unix_path)
        except OSError as e:
            sock.close()
            raise OwnerGone(h, f"cannot connect: {e.strerror or e}") from None
        return sock
    sock, last = None, None
    for addr in h.addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect((addr, h.port))
            sock = s
            break
        except OSError as e:
            last = e
            s.close()
    if sock is None:
        raise OwnerGone(h, f"cannot reach it at {', '.join(h.addresses)} port {h.port}: {last}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


class Connection:
    """A pooled connection, returned to the pool only if the transfer completed cleanly."""

    def __init__(self, h, via: str, key: bytes, timeout: float | None):
        self.h, self.key_ = h, (h.instance, via)
        with _lock:
            free = _pool.get(self.key_)
            self.sock = free.pop() if free else None
        if self.sock is None:
            self.sock = _connect(h, via, key)
        self.sock.settimeout(timeout)

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            with _lock:
                _pool.setdefault(self.key_, []).append(self.sock)
        else:
            self.sock.close()
        return False


def _request(sock, h, op: int, offset: int, nbytes: int) -> bytes:
    sock.sendall(wire.REQUEST.pack(op, h.id, h.token, offset, nbytes))
    status, msg = wire.recv_reply(sock)
    _raise_for(h, status, msg)
    return msg


def _raise_for(h, status: int, msg: bytes) -> None:
    if status == wire.OK:
        return
    text = msg.decode(errors="replace")
    if status == wire.GONE:
        raise BufferDropped(text)
    if status in (wire.FORGED, wire.STALE):
        raise ForgedHandle(text)
    if status == wire.RANGE:
        raise ValueError(text)
    raise TransferError(text)


def _guard(h, fn):
    """Run ``fn`` turning a dead connection into the owner's death."""
    try:
        return fn()
    except (ConnectionError, BrokenPipeError) as e:
        raise OwnerGone(h, f"the connection broke mid-transfer ({e})") from None
    except socket.timeout:
        raise TimeoutError(f"buffer {h.name!r}: no progress from its owner within the timeout") from None


# ---------------------------------------------------------------- stream (tcp, or unix on one host)


def stream(h, key: bytes, via: str, op: int, view: memoryview, offset: int, timeout: float | None) -> None:
    def run():
        with Connection(h, via, key, timeout) as sock:
            _request(sock, h, op, offset, view.nbytes)
            if op == wire.READ:
                wire.recv_into_all(sock, view)
            else:
                sock.sendall(view)
                _raise_for(h, *wire.recv_reply(sock))

    _guard(h, run)


STREAM_MIN = 8 << 20  # below this, one connection is as fast as several


def parallel_streams(h, key: bytes, op: int, view: memoryview, offset: int, timeout: float | None,
                     streams: int) -> None:
    """Split a large TCP transfer over ``streams`` connections, one thread each."""
    n = view.nbytes
    if streams <= 1 or n < STREAM_MIN:
        stream(h, key, "tcp", op, view, offset, timeout)
        return
    step = -(-n // streams)
    errors: list[BaseException] = []

    def part(start: int) -> None:
        try:
            stream(h, key, "tcp", op, view[start:start + step], offset + start, timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=part, args=(s,), daemon=True) for s in range(step, n, step)]
    for t in threads:
        t.start()
    part(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- shm (one host, one copy)
#
# The owner answers MAP with either a descriptor of the shared segment its memory lives in
# (mapped here once, then each transfer is a memcpy), or, for memory that could not move
# there (numpy arrays, bytearrays), its pid and the address, which this process reads or
# writes with process_vm_readv/writev: still one copy, straight between the two address
# spaces.  Where the kernel forbids that (ptrace rules), the bytes stream over the socket.


class _Mapped:
    def __init__(self, mm: mmap.mmap, base: int):
        self.mm, self.base = mm, base

    def transfer(self, op: int, view: memoryview, offset: int) -> None:
        start = self.base + offset
        window = memoryview(self.mm)[start:start + view.nbytes]
        if op == wire.READ:
            copy(view, window)
        else:
            copy(window, view)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a view of it is still alive; the mapping goes with it


class _CrossMemory:
    def __init__(self, pid: int, addr: int):
        self.pid, self.addr = pid, addr

    def transfer(self, op: int, view: memoryview, offset: int) -> None:
        n = view.nbytes
        if n == 0:
            return
        local = _iovec(ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
        done = 0
        fn = _libc.process_vm_readv if op == wire.READ else _libc.process_vm_writev
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


_libc = ctypes.CDLL(None, use_errno=True)
for _f in (_libc.process_vm_readv, _libc.process_vm_writev):
    _f.restype = ctypes.c_ssize_t
    _f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_no_cma: set = set()  # owners whose memory this process may not access directly


def _mapping(h, sock):
    k = (h.instance, h.id)
    with _lock:
        got = _maps.get(k)
    if got is not None:
        return got
    sock.sendall(wire.REQUEST.pack(wire.MAP, h.id, h.token, 0, 0))
    head, fds, _flags, _addr = socket.recv_fds(sock, wire.REPLY.size, 1)
    if len(head) < wire.REPLY.size:
        raise ConnectionResetError("closed while mapping")
    status, n = wire.REPLY.unpack(head)
    msg = wire.recv_exact(sock, n) if n else b""
    if status != wire.OK:
        for fd in fds:
            socket.close(fd)
        if status == NOT_SHARED:
            return None
        _raise_for(h, status, msg)
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


def forget(h) -> None:
    with _lock:
        _cuda.pop((h.instance, h.id), None)
        got = _maps.pop((h.instance, h.id), None)
    if got is not None:
        got.close()


def shm(h, key: bytes, op: int, view: memoryview, offset: int, timeout: float | None) -> None:
    def run() -> bool:
        with Connection(h, "unix", key, timeout) as sock:
            path = None if h.instance in _no_cma and not h.shared else _mapping(h, sock)
            if path is None or (view.readonly and isinstance(path, _CrossMemory)):
                return False
            _request(sock, h, wire.CHECK, offset, view.nbytes)  # alive, not dropped, in range
            try:
                path.transfer(op, view, offset)
            except _NoCrossMemory:
                _no_cma.add(h.instance)
                forget(h)
                return False
            return True

    try:
        if not _guard(h, run):
            stream(h, key, "unix", op, view, offset, timeout)
    except (BufferDropped, OwnerGone, ForgedHandle):
        forget(h)
        raise


def copy(dst: memoryview, src: memoryview) -> None:
    """memcpy without the GIL where both buffers allow it, so concurrent copies overlap."""
    n = dst.nbytes
    if n == 0:
        return
    if not dst.readonly and not src.readonly:
        d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        s = ctypes.addressof(ctypes.c_char.from_buffer(src))
        ctypes.memmove(d, s, n)
    else:
        dst[:] = src


# ---------------------------------------------------------------- cuda_ipc (one host, GPU)


_cuda: dict[tuple, object] = {}  # (owner, buffer) -> the owner's storage, opened once


def cuda_ipc(h, key: bytes, op: int, target, offset: int, nbytes: int, timeout: float | None) -> None:
    """Open the owner's CUDA storage through its IPC handle (once), then copy on the device."""
    import torch

    k = (h.instance, h.id)

    def run():
        with Connection(h, "unix", key, timeout) as sock:
            if k not in _cuda:
                info = json.loads(_request(sock, h, wire.MAP, 0, 0) or b"{}")
                if not info.get("cuda"):
                    raise TransferError(f"buffer {h.name!r} has no CUDA IPC handle (it is not CUDA memory)")
                handle, base = info["cuda"]
                args = [bytes.fromhex(x["b"]) if isinstance(x, dict) else x for x in handle]
                storage = torch.UntypedStorage._new_shared_cuda(*args)
                remote = torch.empty(0, dtype=torch.uint8, device=storage.device)
                _cuda[k] = remote.set_(storage, base, (h.size,))
            _request(sock, h, wire.CHECK, offset, nbytes)  # alive, not dropped, in range

    try:
        _guard(h, run)
    except (BufferDropped, OwnerGone, ForgedHandle):
        forget(h)
        raise
    window = _cuda[k][offset:offset + nbytes]
    if op == wire.READ:
        target.copy_(window)
    else:
        window.copy_(target)
    torch.cuda.synchronize(window.device)
