"""Message authentication: HMAC-SHA256 with the job key, checked before any unpickling.

The MAC covers the header, every pickle stream, and the length and position of every
out-of-band buffer; buffers under ``BULK`` bytes are covered byte for byte.  Large buffers
are raw data that no pickle executes, and a message cannot be forged or spliced without
the key, so hashing gigabytes of tensor bytes twice per hop buys nothing on local links;
cross-host links get CurveZMQ for in-path integrity.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import struct
from dataclasses import dataclass, field

import zmq

from . import native, rejects
from .envelope import MAX_HEADER, Header
from .payloads import decode_payload

BULK = 1 << 20
SMALL = 1 << 16  # below this, join and hash once
MAC_LEN = 32
VOUCH_LEN = 16  # a same-host message's first piece carries this much of a MAC (``vouch``)
_VOUCH = b"monarch-kernel/datagram first piece\0"  # (no message's MAC covers bytes that begin so)


@functools.lru_cache(maxsize=64)
def _lengths(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


class Dropped(Exception):
    """A message that failed a check; ``reason`` is the counter it increments."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Post-authentication "malformed" drops also happen in normal runs (an answer to a port that
# closed meanwhile): logged at DEBUG (ranks show INFO in the notebook); the others say
# someone sent what no process of the job would.
_QUIET = frozenset(("malformed",))


@dataclass
class DropCounts:
    """This runtime's envelope drops by reason (``Runtime.stats()["dropped"]``); each is also
    counted and logged on the process's ``rejects`` registry as wire ``envelope``."""

    unsigned: int = 0
    forged: int = 0
    truncated: int = 0
    oversized: int = 0
    malformed: int = 0
    curve: int = 0  # connections refused for lacking the job's Curve key (never read at all)
    by_reason: dict = field(default_factory=dict)

    def count(self, reason: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        rejects.count("envelope", reason, level=logging.DEBUG if reason in _QUIET else logging.WARNING)


def _len(f) -> int:
    return f.nbytes if type(f) is memoryview else len(f)


class Signer:
    """Signs outgoing frames and verifies incoming ones with one shared key."""

    def __init__(self, key: bytes, max_frame: int = 1 << 34, max_frames: int = 1 << 16,
                 wire: bool | None = None):
        """``wire``: use the C hot path (``native.py``) for ``seal``/``open`` (None: when it is
        built and ``MONARCH_KERNEL_NATIVE_WIRE`` allows; False: pure Python)."""
        if len(key) < 16:
            raise ValueError("the job key must be at least 16 bytes")
        from . import framing  # (framing imports this module)

        self._pack, self._unpack = framing.pack, framing.unpack
        self._wire = native.wire() if wire is not False else None
        if wire and self._wire is None:
            raise RuntimeError(native.is_available()[1])
        self._keys = self._wire.Keys(key) if self._wire is not None else None
        self._native_ring: dict = {}  # mesh id -> Keys, beside ``keyring``
        # HMAC-SHA256 (RFC 2104) with the padded-key states hashed once: OpenSSL's own
        # HMAC set-up costs more than hashing a small message.
        padded = key.ljust(64, b"\0") if len(key) <= 64 else hashlib.sha256(key).digest().ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))
        self.keyring: dict[str, Signer] = {}  # mesh id -> signer, for meshes of another job
        self.max_frame = max_frame
        self.max_frames = max_frames

    def oversized(self, frames: list) -> bool:
        """Whether a frame of ``frames`` is over the limit receivers drop (``check_size`` says
        how); cheap, so that a sender asks it before building the words of a refusal."""
        limit = self.max_frame
        for f in frames:
            if (f.nbytes if type(f) is memoryview else len(f)) > limit:
                return True
        return False

    def check_size(self, frames: list, what: str) -> None:
        """Refuse, before sending, ``frames`` a receiver would drop as oversized: ``what``
        (e.g. "the arguments of train") names what needs the frame."""
        limit = self.max_frame
        for f in frames:
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            if n > limit:
                raise ValueError(
                    f"{what} need a {n}-byte frame, over the {limit}-byte limit the receiver "
                    f"would drop; raise MONARCH_KERNEL_MAX_FRAME (bytes) before spawning"
                )

    def _mac(self, header_bytes, header: Header, body: list) -> bytes:
        lens = [f.nbytes if type(f) is memoryview else len(f) for f in body]
        covered = [header_bytes, _lengths(len(lens)).pack(*lens)]
        total = 0
        i = 0
        for _rank, _status, nbufs in header.parts:
            covered.append(body[i])  # the pickle stream, always
            total += lens[i]
            for j in range(i + 1, i + 1 + nbufs):
                if lens[j] < BULK:
                    covered.append(body[j])
                    total += lens[j]
            i += 1 + nbufs
        inner = self._inner.copy()
        if total < SMALL:
            inner.update(b"".join(covered))
        else:
            for c in covered:
                inner.update(c)
        return self._outer_digest(inner)

    def _outer_digest(self, inner) -> bytes:
        """HMAC's outer hash over the finished ``inner`` one."""
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def vouch(self, head: bytes) -> bytes:
        """A short MAC, with this signer's key, of the head of a same-host message's first
        piece (``net/datagram.py``): a listener holds no piece of a message begun by a process
        without a key of the job, so such a process cannot evict a real one for room."""
        inner = self._inner.copy()
        inner.update(_VOUCH + head)
        return self._outer_digest(inner)[:VOUCH_LEN]

    def vouched(self, head: bytes, mac: bytes) -> bool:
        """Whether ``mac`` is ``vouch(head)`` with this job's key or a key of the keyring
        (a mesh of another job, whose ranks sign with their own)."""
        if hmac.compare_digest(self.vouch(head), mac):
            return True
        seen = {id(self)}
        for other in list(self.keyring.values()):
            if id(other) not in seen:
                seen.add(id(other))
                if hmac.compare_digest(other.vouch(head), mac):
                    return True
        return False

    def for_mesh(self, mesh: str) -> Signer:
        """The signer of messages about ``mesh``: its job's, from the keyring, or this one."""
        return self.keyring.get(mesh, self) if self.keyring else self

    def add_key(self, mesh_ids, key: bytes) -> None:
        """Speak to (and accept messages about) these meshes with their own job's key."""
        other = Signer(key, self.max_frame, self.max_frames, wire=self._wire is not None)
        for m in mesh_ids:
            self.keyring[m] = other
            self._native_ring[m] = other._keys

    @property
    def native(self) -> bool:
        """Whether ``seal`` and ``open`` run in C."""
        return self._wire is not None

    def seal(self, header: Header, body: list) -> list:
        """The frames to send: signed, with the MAC, the header and the small parts in the
        first frame (``framing.py``)."""
        if self._wire is None:
            return self._pack(self.sign(header, body))
        signer = self.for_mesh(header.mesh)
        return self._wire.seal(signer._keys, header, body)

    def open(self, frames: list) -> tuple[Header, list]:
        """``(header, body)`` of the message received as ``frames``, or raise ``Dropped``."""
        if self._wire is None:
            return self.verify(self._unpack(frames))
        got = self._wire.open(self._keys, self._native_ring, frames, Header, decode_payload,
                              self.max_frame, self.max_frames)
        if type(got) is str:
            raise Dropped(got)
        return got

    def sign(self, header: Header, body: list) -> list:
        hb = header.encode()
        signer = self.for_mesh(header.mesh)
        return [signer._mac(hb, header, body), hb, *body]

    def verify(self, frames: list) -> tuple[Header, list]:
        """Return ``(header, body)`` of an authentic message or raise ``Dropped``."""
        if len(frames) < 2:
            raise Dropped("unsigned")
        if len(frames) > self.max_frames:
            raise Dropped("oversized")
        bufs = [f.buffer if type(f) is zmq.Frame else f for f in frames]
        mac, hb, body = bufs[0], bufs[1], bufs[2:]
        if _len(mac) != MAC_LEN:
            raise Dropped("unsigned")
        if _len(hb) > MAX_HEADER or any(_len(b) > self.max_frame for b in body):
            raise Dropped("oversized")
        try:
            header = Header.decode(hb)
        except ValueError:
            raise Dropped("malformed") from None
        if header.frame_count() != len(body):
            # Either forged layout or a message cut short; the MAC cannot be checked.
            raise Dropped("truncated")
        signer = self.for_mesh(header.mesh)
        if not hmac.compare_digest(signer._mac(hb, header, body), mac):
            raise Dropped("forged")
        return header, frames[2:]
