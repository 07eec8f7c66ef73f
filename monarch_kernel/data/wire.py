"""The data plane's wire protocol: the mutual HMAC handshake, every op and status code as an
``IntEnum``, and the struct formats of requests and replies.  It must never know what a
transport does with an op (that is each transport's module) nor hash the bulk bytes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import socket
import struct
import time
from dataclasses import dataclass

from ..runtime import rejects

# One stream socket (Unix on one host, TCP across hosts) carries many requests, one at a
# time.  The handshake proves both ends hold the job key with fresh nonces on both sides, so
# a recorded session cannot be replayed; after it, bulk bytes travel unhashed, as on the
# control plane (runtime/wire/auth.py), straight between the memories with sendall/recv_into.
# The handshake has one deadline in all, not one per recv, so a peer that drips bytes cannot
# hold a connection open; a server with too many handshakes in progress answers BUSY and
# closes, and the client tries again shortly.

MAGIC = b"MKD1"
BUSY = b"MKDB"  # instead of MAGIC: too many handshakes in progress, try again shortly
NONCE = 16
MAC = 32


class Op(enum.IntEnum):
    """What a request asks of the owner (one byte on the wire)."""

    READ = 1  # stream bytes to the reader
    WRITE = 2  # take bytes from the reader
    MAP = 3  # how to reach the memory directly: an shm segment, a pid and address, a CUDA IPC handle
    CHECK = 4  # alive, not dropped, in range: before a transfer that bypasses the socket
    DROP = 5  # release the registration
    IB_CONNECT = 6  # connect a queue pair; a length-prefixed blob of the reader's details follows
    LIVE = 7  # the owner's page of liveness words (liveness.py), as a descriptor: Unix socket only


class Status(enum.IntEnum):
    """The owner's answer (one byte on the wire), followed by a message explaining it."""

    OK = 0
    GONE = 1  # dropped by its owner
    FORGED = 2  # no such buffer, or the wrong token
    RANGE = 3  # outside the buffer, or an unknown op
    STALE = 4  # from an earlier incarnation of the owner
    READONLY = 5  # a write to memory registered read-only
    NOT_SHARED = 6  # MAP: this memory cannot be reached directly; stream it instead
    RDMA_SETUP = 7  # IB_CONNECT: the owner could not set up its end of the queue pair


REQUEST = struct.Struct("<BQ16sQQ")  # op, buffer id, token, offset, nbytes
REPLY = struct.Struct("<BI")  # status, length of the message that follows
LENGTH = struct.Struct("<I")  # length of a blob (IB_CONNECT's queue-pair details)
# A reply's message is a sentence, a JSON line (MAP) or a queue pair's details; a blob, a
# queue pair's details: far below this.  A longer length is refused before it is read.
MAX_MESSAGE = 1 << 20


@dataclass(frozen=True)
class Request:
    """One request; ``op`` is an ``Op``, or the bare number of one this end does not know
    (the server answers that with ``RANGE``)."""

    op: Op | int
    bid: int
    token: bytes
    offset: int
    nbytes: int

    def encode(self) -> bytes:
        return REQUEST.pack(self.op, self.bid, self.token, self.offset, self.nbytes)

    @classmethod
    def decode(cls, raw: bytes) -> Request:
        op, bid, token, offset, nbytes = REQUEST.unpack(raw)
        return cls(_known(Op, op), bid, token, offset, nbytes)


@dataclass(frozen=True)
class Reply:
    """One reply: a ``Status`` (or the bare number of one this end does not know) and the
    message that explains it, or the owner's answer to ``MAP``/``IB_CONNECT``."""

    status: Status | int
    message: bytes = b""

    def encode(self) -> bytes:
        return REPLY.pack(self.status, len(self.message)) + self.message


def _known(kind: type[enum.IntEnum], n: int):
    try:
        return kind(n)
    except ValueError:
        return n


class HandshakeFailed(ConnectionError):
    pass


class ProtocolError(ConnectionError):
    """The peer sent what this wire never carries (a length over ``MAX_MESSAGE``); the
    connection is closed."""


class Busy(ConnectionError):
    """The server turned the connection away before the handshake; it is alive."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_all(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view``; ``deadline`` (time.monotonic()) bounds the whole, not each recv."""
    got, n = 0, view.nbytes
    while got < n:
        if deadline is not None:
            sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the other end closed the connection")
        got += k


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake did not finish in time")
    return left


def server_handshake(sock: socket.socket, key: bytes, deadline: float) -> None:
    ns = secrets.token_bytes(NONCE)
    sock.settimeout(_left(deadline))
    sock.sendall(MAGIC + ns)
    msg = recv_exact(sock, NONCE + MAC, deadline)
    nc, mac = msg[:NONCE], msg[NONCE:]
    if not hmac.compare_digest(mac, _mac(key, b"client", ns, nc)):
        raise HandshakeFailed("the client does not hold this job's key")
    sock.settimeout(_left(deadline))
    sock.sendall(_mac(key, b"server", nc, ns))


def turn_away(sock: socket.socket) -> None:
    """Close a connection the server has no room for, saying so without ever blocking."""
    sock.setblocking(False)
    try:
        sock.send(BUSY)
    except OSError:
        pass
    sock.close()


def client_handshake(sock: socket.socket, key: bytes) -> None:
    magic = recv_exact(sock, len(MAGIC))
    if magic == BUSY:
        raise Busy("the data server has too many connections waiting to authenticate")
    if magic != MAGIC:
        raise HandshakeFailed("not a monarch-kernel data server")
    ns = recv_exact(sock, NONCE)
    nc = secrets.token_bytes(NONCE)
    sock.sendall(nc + _mac(key, b"client", ns, nc))
    if not hmac.compare_digest(recv_exact(sock, MAC), _mac(key, b"server", nc, ns)):
        raise HandshakeFailed("the data server does not hold this job's key")


def send_request(sock: socket.socket, op: Op, h, offset: int, nbytes: int, blob: bytes | None = None) -> None:
    """Ask ``h``'s owner for ``op`` on ``nbytes`` at ``offset``; ``blob`` follows, length first."""
    raw = Request(op, h.id, h.token, offset, nbytes).encode()
    sock.sendall(raw if blob is None else raw + LENGTH.pack(len(blob)) + blob)


def recv_request(sock: socket.socket) -> Request:
    return Request.decode(recv_exact(sock, REQUEST.size))


def recv_blob(sock: socket.socket) -> bytes:
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    return recv_exact(sock, _bounded(n, "a request's blob"))


def _bounded(n: int, what: str) -> int:
    if n > MAX_MESSAGE:
        rejects.count("data", "oversized", f"{what} of {n} bytes (at most {MAX_MESSAGE})")
        raise ProtocolError(f"{what} of {n} bytes is over the data plane's {MAX_MESSAGE}-byte limit: "
                            "the peer is not a monarch-kernel data server or client of this version")
    return n


def send_reply(sock: socket.socket, status: Status, message: bytes = b"") -> None:
    sock.sendall(Reply(status, message).encode())


def decode_reply_head(raw: bytes) -> tuple[Status | int, int]:
    """The status and message length of a reply's fixed-size head."""
    status, n = REPLY.unpack(raw)
    return _known(Status, status), _bounded(n, "a reply's message")


def recv_reply(sock: socket.socket) -> Reply:
    status, n = decode_reply_head(recv_exact(sock, REPLY.size))
    return Reply(status, recv_exact(sock, n) if n else b"")
