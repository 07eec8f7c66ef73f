"""The data plane's wire protocol: a mutual HMAC handshake, then fixed-size requests.

One stream socket (Unix on one host, TCP across hosts) carries many requests, one at a time.
The handshake proves both ends hold the job key with fresh nonces on both sides, so a
recorded session cannot be replayed; after it, bulk bytes travel unhashed, as on the control
plane (``runtime/auth.py``), and go straight from the source memory to the destination with
``sendall``/``recv_into``.  The handshake has one deadline in all, not one per ``recv``, so a
peer that drips bytes cannot hold a connection open; a server with too many handshakes in
progress answers ``BUSY`` and closes, and the client tries again shortly.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

MAGIC = b"MKD1"
BUSY = b"MKDB"  # instead of MAGIC: too many handshakes in progress, try again shortly
NONCE = 16
MAC = 32

# ops
READ, WRITE, MAP, CHECK, DROP = 1, 2, 3, 4, 5
# statuses
OK, GONE, FORGED, RANGE, STALE, READONLY = 0, 1, 2, 3, 4, 5

REQUEST = struct.Struct("<BQ16sQQ")  # op, buffer id, token, offset, nbytes
REPLY = struct.Struct("<BI")  # status, length of the message that follows


class HandshakeFailed(ConnectionError):
    pass


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


def send_reply(sock: socket.socket, status: int, message: bytes = b"") -> None:
    sock.sendall(REPLY.pack(status, len(message)) + message)


def recv_reply(sock: socket.socket) -> tuple[int, bytes]:
    status, n = REPLY.unpack(recv_exact(sock, REPLY.size))
    return status, (recv_exact(sock, n) if n else b"")
