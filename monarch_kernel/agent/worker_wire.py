"""The wire between a worker (``python -m monarch_kernel.agent --listen``) and a controller
that attaches to it: a bounded handshake that proves both hold the key file's key, then a
session of small signed messages.  Both sides import it; it holds neither side's state.

The handshake, on a plain TCP connection, before anything else is read::

    worker     -> controller: MAGIC, worker nonce (16)          (or BUSY, then close)
    controller -> worker:     controller nonce (16), HMAC(key, "controller", both nonces)
    worker     -> controller: HMAC(key, "worker", both nonces)   (or REFUSED, then close)

The worker reads exactly 48 bytes of an unknown peer, within one deadline for the whole
handshake.  Then each side sends frames ``length (4) | HMAC (32) | msgpack message``, each
signed with the session key (``worker_key.session_key``) over its direction and sequence
number, so none can be forged, replayed or reordered; a frame over ``MAX_MESSAGE`` is refused
from its length.  No message is secret: the job's credentials go over a separate CurveZMQ
connection whose keys are derived from the session key (``worker_key.session_curve``), and
nothing on either side is ever unpickled.
"""

# No ``from __future__ import annotations``: ``Message`` reads the field types at run time.

import hmac
import secrets
import socket
import struct
import time
from dataclasses import dataclass

import msgpack

from ..runtime.hosting import config
from ..runtime.hosting import host_messages as hw
from .worker_key import mac, session_key

# The worker wire's messages are host messages (one msgpack encoding each, checked on decoding).
Message = hw.Message
MalformedMessage = hw.MalformedMessage

MAGIC = b"MKW1"
BUSY = b"MKWB"  # instead of MAGIC: too many connections are proving the key; try again shortly
REFUSED = b"MKWX"  # instead of the worker's proof: the controller's proof was wrong
NONCE = 16
MAC = 32
HELLO = NONCE + MAC  # what the worker reads of a peer before it knows who it is
LENGTH = struct.Struct("<I")
MAX_MESSAGE = 1 << 16
HANDSHAKE_S = config.seconds("worker_handshake")


class HandshakeFailed(ConnectionError):
    """The other side does not hold the key (or is not a worker at all)."""


class WorkerBusy(ConnectionError):
    """The worker turned the connection away before the handshake: too many at once."""


# ---------------------------------------------------------------- the session's messages


@dataclass(frozen=True)
class Hello(Message):
    """(worker) Who it is, and whether it is free: ``state`` is "free", "busy" (another
    controller holds it: ``holder`` says which) or "ending" (it is ending the ranks of the
    controller before; free in a moment)."""

    OP = "hello"
    state: str
    holder: str
    hostname: str
    pid: int
    python: str


@dataclass(frozen=True)
class Attach(Message):
    """(controller) Take this worker; ``who`` is how the worker names the controller in its
    log and to others who ask.  Answered by ``Channel``, or ``Ended`` saying why not."""

    OP = "attach"
    who: str


@dataclass(frozen=True)
class Channel(Message):
    """(worker) The TCP port (on the address the controller reached) where it waits, within
    the handshake's deadline, for the credentials, over CurveZMQ with the session's keys."""

    OP = "channel"
    port: int


@dataclass(frozen=True)
class Started(Message):
    """(worker) Its agent started with the credentials (``pid``); it connects back to the
    controller as an ssh-started one does."""

    OP = "started"
    pid: int


@dataclass(frozen=True)
class Ended(Message):
    """(worker) Its agent is gone (or never started), and why; the worker then closes the
    connection and waits for the next controller."""

    OP = "ended"
    why: str


@dataclass(frozen=True)
class Release(Message):
    """(controller) End the agent and its ranks; wait for the next controller."""

    OP = "release"


@dataclass(frozen=True)
class Shutdown(Message):
    """(controller) End the agent and its ranks, then exit (``job.kill()``)."""

    OP = "shutdown"


OPS: dict[str, type[Message]] = {cls.OP: cls for cls in (Hello, Attach, Channel, Started, Ended, Release, Shutdown)}


def decode(data: bytes) -> Message:
    """The message in ``data``; ``MalformedMessage`` for anything else."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:
        raise MalformedMessage(f"not a msgpack message: {e}") from None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str) or raw[0] not in OPS:
        raise MalformedMessage(f"not a message of the worker wire: {raw!r:.80}")
    return OPS[raw[0]].from_values(raw[1:])


class Codec:
    """Signs what one side sends and checks what it receives, in order, with the session key."""

    def __init__(self, session: bytes, worker: bool):
        self._session = session
        self._out, self._in = (b"w>c", b"c>w") if worker else (b"c>w", b"w>c")
        self._sent = 0
        self._received = 0

    def pack(self, msg: Message) -> bytes:
        body = msg.encode()
        if len(body) > MAX_MESSAGE:
            raise ValueError(f"a {msg.OP} message of {len(body)} bytes is over the worker wire's {MAX_MESSAGE}")
        sig = mac(self._session, self._out, struct.pack("<Q", self._sent), body)
        self._sent += 1
        return LENGTH.pack(len(body)) + sig + body

    @staticmethod
    def length(head: bytes) -> int:
        """The body's length from a frame's first 4 bytes; ``MalformedMessage`` if too long."""
        (n,) = LENGTH.unpack(head)
        if n > MAX_MESSAGE:
            raise MalformedMessage(f"a frame of {n} bytes is over the worker wire's {MAX_MESSAGE}")
        return n

    def unpack(self, sig: bytes, body: bytes) -> Message:
        """The message of a frame; ``HandshakeFailed`` if it is not signed by the other side
        as its next one, ``MalformedMessage`` if it is no message."""
        want = mac(self._session, self._in, struct.pack("<Q", self._received), body)
        if not _equal(sig, want):
            raise HandshakeFailed("a message not signed with this session's key (forged, replayed or reordered)")
        self._received += 1
        return decode(body)


def _equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# ---------------------------------------------------------------- the controller's side (blocking)


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the worker did not answer in time")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionResetError("the worker closed the connection")
        buf += got
    return bytes(buf)


def client_handshake(sock: socket.socket, key: bytes, deadline: float) -> bytes:
    """Prove the key to the worker on ``sock`` and check its proof; returns the session key."""
    first = recv_exact(sock, len(MAGIC), deadline)
    if first == BUSY:
        raise WorkerBusy("the worker has too many connections proving the key at once")
    if first != MAGIC:
        raise HandshakeFailed("it is not a monarch-kernel worker (it does not speak the worker wire)")
    nw = recv_exact(sock, NONCE, deadline)
    nc = secrets.token_bytes(NONCE)
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    sock.sendall(nc + mac(key, b"controller", nw, nc))
    proof = recv_exact(sock, len(REFUSED), deadline)
    if proof == REFUSED:
        raise HandshakeFailed("it refused this controller's key")
    proof += recv_exact(sock, MAC - len(REFUSED), deadline)
    if not _equal(proof, mac(key, b"worker", nc, nw)):
        raise HandshakeFailed("it does not hold this key (its proof is wrong)")
    return session_key(key, nw, nc)


def recv_message(sock: socket.socket, codec: Codec, deadline: float | None) -> Message:
    n = codec.length(recv_exact(sock, LENGTH.size, deadline))
    sig = recv_exact(sock, MAC, deadline)
    return codec.unpack(sig, recv_exact(sock, n, deadline) if n else b"")
