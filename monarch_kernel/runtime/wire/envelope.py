"""The wire envelope: a typed msgpack header, pickle parts and their out-of-band buffers.

Frames on the wire: ``[mac, header, part0, part0 buffers..., part1, ...]``.  The header is
parsed with msgpack (never pickle) so a message can be authenticated before any pickle is
touched; see ``auth.py``.  This module never unpickles anything it has not been told is
authentic.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .kinds import Kind as Kind
from .kinds import Mode as Mode
from .kinds import Status as Status
from .payloads import decode_payload

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
        return pickle.loads(f if type(f) is bytes else _buffer(f))
    data, *bufs = (_buffer(f) for f in frames)
    return pickle.loads(data, buffers=bufs)


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
