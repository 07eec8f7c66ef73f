"""The data plane's wire protocol: a mutual HMAC handshake, then fixed-size requests.

One stream socket (Unix on one host, TCP across hosts) carries many requests, one at a time.
The handshake proves both ends hold the job key with fresh nonces on both sides, so a
recorded session cannot be replayed; after it, bulk bytes travel unhashed, as on the control
plane (``runtime/auth.py``), and go straight from the source memory to the destination with
``sendall``/``recv_into``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

MAGIC = b"MKD1"
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


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf))
    return bytes(buf)


def recv_into_all(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the other end closed the connection")
        got += k


def server_handshake(sock: socket.socket, key: bytes) -> None:
    ns = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + ns)
    msg = recv_exact(sock, NONCE + MAC)
    nc, mac = msg[:NONCE], msg[NONCE:]
    if not hmac.compare_digest(mac, _mac(key, b"client", ns, nc)):
        raise HandshakeFailed("the client does not hold this job's key")
    sock.sendall(_mac(key, b"server", nc, ns))


def client_handshake(sock: socket.socket, key: bytes) -> None:
    hello = recv_exact(sock, len(MAGIC) + NONCE)
    if hello[:4] != MAGIC:
        raise HandshakeFailed("not a monarch-kernel data server")
    ns = hello[4:]
    nc = secrets.token_bytes(NONCE)
    sock.sendall(nc + _mac(key, b"client", ns, nc))
    if not hmac.compare_digest(recv_exact(sock, MAC), _mac(key, b"server", nc, ns)):
        raise HandshakeFailed("the data server does not hold this job's key")


def send_reply(sock: socket.socket, status: int, message: bytes = b"") -> None:
    sock.sendall(REPLY.pack(status, len(message)) + message)


def recv_reply(sock: socket.socket) -> tuple[int, bytes]:
    status, n = REPLY.unpack(recv_exact(sock, REPLY.size))
    return status, (recv_exact(sock, n) if n else b"")
