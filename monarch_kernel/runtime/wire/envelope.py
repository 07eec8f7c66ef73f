"""The wire envelope: a typed msgpack header, pickle parts and their out-of-band buffers.

Frames on the wire: ``[mac, header, part0, part0 buffers..., part1, ...]``.  The header is
parsed with msgpack (never pickle) so a message can be authenticated before any pickle is
touched; see ``auth.py``.  This module never unpickles anything it has not been told is
authentic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from .kinds import Kind as Kind
from .kinds import Mode as Mode
from .kinds import Status as Status
from .payloads import decode_payload
from .unpickling import loads

# A header bigger than this is not a header we wrote.
MAX_HEADER = 64 * 1024

_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


@dataclass(slots=True)
class Header:
    """Everything the runtime routes on; the payload parts are opaque until authentic."""

    kind: int
    call_id: int = 0
    origin: str = ""  # inbox of the process that made the call
    reply_to: str = ""  # where this node sends its (gathered) reply
    mesh: str = ""  # proc mesh id the targets belong to
    actor: str = ""  # actor mesh name on the target ranks
    method: str = ""
    ranks: list[int] = field(default_factory=list)  # subtree: root first
    fanout: int = 8
    mode: int = Mode.GATHER
    resend: bool = False  # a CALL re-sent by the origin after a forwarder died
    hop: int = 0  # 0: between the origin and a tree root; 1: between two ranks
    # One entry per part: [rank, status, number of out-of-band buffers after its pickle].
    parts: list[list[int]] = field(default_factory=list)
    # The kind's typed payload (``payloads.py``): small values that need no pickle.
    payload: Any = None

    _FIELDS = (
        "kind", "call_id", "origin", "reply_to", "mesh", "actor", "method",
        "ranks", "fanout", "mode", "resend", "hop", "parts", "payload",
    )

    # Named constructors: each says which message it makes, so no sender lines up 14 fields.

    @classmethod
    def call(cls, kind: int, call_id: int, origin: str, mesh: str, actor: str, method: str, body: list,
             fanout: int, mode: int, payload) -> Header:
        """A CALL or SPAWN from ``origin`` (answers come back there), carrying ``body`` as one part."""
        return cls(kind, call_id, origin, origin, mesh, actor, method, [], fanout, mode, False, 0,
                   [[-1, Status.OK, len(body) - 1]], payload)

    @classmethod
    def reply(cls, call_id: int, origin: str, reply_to: str, mesh: str, rank: int, to_node: bool,
              direct=None) -> Header:
        """``rank``'s answer to call ``call_id`` made at ``origin``, sent to ``reply_to``: the
        caller (hop 0) or, ``to_node``, the tree node that gathers it (hop 1).  ``direct``: a
        ``ReplyInfo``, the answering actor's own TCP inbox."""
        return cls(Kind.REPLY, call_id, origin, reply_to, mesh, "", "", [rank], 8, Mode.GATHER, False,
                   1 if to_node else 0, [], direct)

    @classmethod
    def control(cls, kind: int, origin: str = "", mesh: str = "", ranks: list[int] | None = None, *,
                call_id: int = 0, actor: str = "", fanout: int = 8, payload=None) -> Header:
        """A small message from ``origin`` that no one answers in kind (REDIRECT, PRUNE, STOP,
        DEATH, INTERRUPT, STACKS, HOST, WAKE...)."""
        return cls(kind, call_id, origin, origin, mesh, actor, "", [] if ranks is None else ranks, fanout,
                   Mode.GATHER, False, 0, [], payload)

    @classmethod
    def not_received(cls, h: Header, rank: int) -> Header:
        """Tells the origin of call ``h`` that ``rank`` never got it (so it sends it again)."""
        return cls(Kind.NOT_RECEIVED, h.call_id, h.origin, h.origin, h.mesh, ranks=[rank])

    @classmethod
    def forward(cls, h: Header, ranks: list[int], reply_to: str | None = None, hop: int | None = None) -> Header:
        """``h`` passed on to the subtree ``ranks``; where its answers go and its hop change
        where given (a tree node gathers its children's answers)."""
        return cls(h.kind, h.call_id, h.origin, h.reply_to if reply_to is None else reply_to, h.mesh, h.actor,
                   h.method, ranks, h.fanout, h.mode, h.resend, h.hop if hop is None else hop, h.parts, h.payload)

    @classmethod
    def resent(cls, h: Header, ranks: list[int]) -> Header:
        """Call ``h`` sent again by its origin straight to the subtree ``ranks`` (its forwarder died)."""
        return cls(h.kind, h.call_id, h.origin, h.origin, h.mesh, h.actor, h.method, ranks, h.fanout, h.mode,
                   True, 0, h.parts, h.payload)

    @classmethod
    def port(cls, port_id: int, origin: str, address: str, mesh: str) -> Header:
        """One value for port ``port_id`` opened by the process at ``address``, signed as a member of ``mesh``."""
        return cls(Kind.PORT, port_id, origin, address, mesh)

    def encode(self) -> bytes:
        return _pack((self.kind, self.call_id, self.origin, self.reply_to, self.mesh, self.actor,
                      self.method, self.ranks, self.fanout, self.mode, self.resend, self.hop,
                      self.parts, self.payload))

    @classmethod
    def decode(cls, data) -> Header:
        """Parse a header from untrusted bytes; raises ``ValueError`` on anything malformed."""
        if len(data) > MAX_HEADER:
            raise ValueError("header too large")
        try:
            values = msgpack.unpackb(
                data, raw=False, strict_map_key=True
            )
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"malformed header: {e}") from None
        if not isinstance(values, list) or len(values) != len(cls._FIELDS):
            raise ValueError("malformed header: wrong shape")
        h = cls(*values)
        if not isinstance(h.kind, int) or not isinstance(h.parts, list):
            raise ValueError("malformed header: wrong types")
        try:
            h.payload = decode_payload(h.kind, h.payload)
        except ValueError as e:
            raise ValueError(f"malformed header: {e}") from None
        for p in h.parts:
            if not (isinstance(p, list) and len(p) == 3 and all(isinstance(x, int) for x in p)):
                raise ValueError("malformed header: bad part layout")
            if p[2] < 0:
                raise ValueError("malformed header: negative buffer count")
        return h

    def frame_count(self) -> int:
        return sum(1 + p[2] for p in self.parts)


@dataclass(slots=True)
class Part:
    """One rank's contribution: a pickle stream and its out-of-band buffers, still encoded."""

    rank: int
    status: int
    frames: list  # [pickle, buf, buf, ...]; bytes, memoryviews or zmq.Frames

    def load(self) -> Any:
        """Unpickle; only ever called on parts of an authenticated message."""
        return load(self.frames)


def load(frames: list) -> Any:
    """Unpickle one part's frames (``Part.load`` without the Part); authentic ones only."""
    if len(frames) == 1:
        f = frames[0]
        return loads(f if type(f) is bytes else _buffer(f))
    data, *bufs = (_buffer(f) for f in frames)
    return loads(data, buffers=bufs)


def _buffer(f):
    return f.buffer if hasattr(f, "buffer") else f


def split_parts(header: Header, frames: list) -> list[Part]:
    """Cut the frames after the header into parts following the header's layout."""
    parts, i = [], 0
    for rank, status, nbufs in header.parts:
        parts.append(Part(rank, status, frames[i : i + 1 + nbufs]))
        i += 1 + nbufs
    return parts


def join_parts(header: Header, parts: list[Part]) -> list:
    """Set the header's layout from ``parts`` and return their frames in order."""
    if len(parts) == 1:
        p = parts[0]
        header.parts = [[p.rank, p.status, len(p.frames) - 1]]
        return list(p.frames)
    header.parts = [[p.rank, p.status, len(p.frames) - 1] for p in parts]
    frames = []
    for p in parts:
        frames.extend(p.frames)
    return frames
