"""The reader's generic half of the data plane: authenticated, pooled connections to owners,
one request at a time, and owners' answers turned into exceptions.  It must never know a
transport (``shm``, ``tcp``, ``ibverbs``, ``cuda_ipc`` build on it) nor import the server.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..runtime import config
from . import wire
from .errors import BufferDropped, ForgedHandle, OwnerGone, RdmaSetupFailed, TransferError

# Connections are pooled per owner and transport; a transfer takes one for its whole
# duration, so concurrent transfers from one process use separate sockets and run in
# parallel.  A connection that fails is thrown away; the next transfer opens a new one.  An
# owner whose server is busy with other handshakes turns a connection away; it is tried
# again shortly.

CONNECT_TIMEOUT_S = config.seconds("data_connect_timeout")
BUSY_WAIT_S = config.seconds("data_busy_wait")

_pool: dict[tuple, list[socket.socket]] = {}
_lock = threading.Lock()
_close_at_exit = [False]  # whether close_pool() is registered (at the first pooled socket)


def close_pool() -> None:
    """Close every pooled connection (at exit: an open socket left to the GC warns)."""
    with _lock:
        socks = [s for free in _pool.values() for s in free]
        _pool.clear()
    for s in socks:
        s.close()

T = TypeVar("T")


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
    sock: socket.socket | None
    if via == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(h.unix_path)
        except OSError as e:
            sock.close()
            raise OwnerGone(h, f"cannot connect: {e.strerror or e}") from None
        return sock
    sock = None
    last: OSError | None = None
    for addr in h.addresses:
        family, where = _route(addr, h.port)
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            s.connect(where)
            sock = s
            break
        except OSError as e:
            last = e
            s.close()
    if sock is None:
        raise OwnerGone(h, f"cannot reach it at {', '.join(h.addresses)} port {h.port}: {last}")
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def _route(ip: str, port: int) -> tuple[int, str | tuple[str, int]]:
    """The socket family and address that reach ``ip:port``: where this process's control
    connections to it would go (an ssh forward's unix socket, for a host beyond a login
    node: ``out_of_cluster``), else ``ip:port`` itself."""
    from ..runtime import Runtime

    rt = Runtime.existing()
    got = rt.route(f"tcp://{ip}:{port}") if rt is not None else f"tcp://{ip}:{port}"
    if got.startswith("ipc://"):
        return socket.AF_UNIX, got[len("ipc://"):]
    host, _, to = got[len("tcp://"):].rpartition(":")
    return socket.AF_INET, (host, int(to))


class Connection:
    """A pooled connection to ``h``'s owner over ``via`` ("unix" or "tcp"), returned to the
    pool only if the transfer completed cleanly.

    Example::

        with Connection(h, "tcp", key, timeout) as sock:
            request(sock, h, wire.Op.CHECK, offset, nbytes)
    """

    def __init__(self, h, via: str, key: bytes, timeout: float | None):
        self.h, self.key_ = h, (h.instance, via)
        with _lock:
            free = _pool.get(self.key_)
            sock = free.pop() if free else None
        if sock is None:
            sock = _connect(h, via, key)
        sock.settimeout(timeout)
        self.sock: socket.socket | None = sock

    def __enter__(self) -> socket.socket:
        assert self.sock is not None, "a detached connection"
        return self.sock

    def detach(self) -> socket.socket:
        """The socket, taken out of the pool for good (the caller closes it)."""
        sock, self.sock = self.sock, None
        assert sock is not None, "detached twice"
        return sock

    def __exit__(self, exc_type, exc, tb):
        if self.sock is None:
            return False  # detached
        if exc_type is None:
            with _lock:
                _pool.setdefault(self.key_, []).append(self.sock)
                if not _close_at_exit[0]:
                    _close_at_exit[0] = True
                    atexit.register(close_pool)
        else:
            self.sock.close()
        return False


def request(sock: socket.socket, h, op: wire.Op, offset: int, nbytes: int, blob: bytes | None = None) -> bytes:
    """Send one request for ``h`` and return the owner's message; any status but OK raises."""
    wire.send_request(sock, op, h, offset, nbytes, blob)
    reply = wire.recv_reply(sock)
    raise_for(h, reply.status, reply.message)
    return reply.message


def request_fds(sock: socket.socket, h, op: wire.Op) -> tuple[int, bytes, list[int]]:
    """Send one request whose answer may carry descriptors (Unix socket only): the status,
    the message and the descriptors, which the caller owns (closes or keeps)."""
    wire.send_request(sock, op, h, 0, 0)
    head, fds, _flags, _addr = socket.recv_fds(sock, wire.REPLY.size, 2)
    if len(head) < wire.REPLY.size:
        for fd in fds:
            socket.close(fd)
        raise ConnectionResetError("closed while waiting for descriptors")
    status, n = wire.decode_reply_head(head)
    return status, wire.recv_exact(sock, n) if n else b"", fds


def raise_for(h, status: int, message: bytes) -> None:
    """Raise the exception an owner's ``status`` stands for, with its ``message``."""
    if status == wire.Status.OK:
        return
    text = message.decode(errors="replace")
    if status == wire.Status.GONE:
        raise BufferDropped(text)
    if status in (wire.Status.FORGED, wire.Status.STALE):
        raise ForgedHandle(text)
    if status == wire.Status.RANGE:
        raise ValueError(text)
    if status == wire.Status.RDMA_SETUP:
        raise RdmaSetupFailed(text)
    raise TransferError(text)


def guarded(h, fn: Callable[[], T]) -> T:
    """Run ``fn``, turning a dead connection into the owner's death and a stalled one into
    ``TimeoutError``."""
    try:
        return fn()
    except (ConnectionError, BrokenPipeError) as e:
        raise OwnerGone(h, f"the connection broke mid-transfer ({e})") from None
    except TimeoutError:
        raise TimeoutError(f"buffer {h.name!r}: no progress from its owner within the timeout") from None
