"""The wire envelope: a typed msgpack header, pickle parts and their out-of-band buffers.

Frames on the wire: ``[mac, header, part0, part0 buffers..., part1, ...]``.  The header is
parsed with msgpack (never pickle) so a message can be authenticated before any pickle is
touched; see ``auth.py``.  This module never unpickles anything it has not been told is
authentic.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

import msgpack

# A header bigger than this is not a header we wrote.
MAX_HEADER = 64 * 1024

_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


class Kind(enum.IntEnum):
    HELLO = 1  # unused since hellos travel through the template (template_wire.HELLO); kept for the wire
    CALL = 2  # caller -> ranks (through the tree): run an endpoint
    REPLY = 3  # ranks -> caller: one part per rank
    SPAWN = 4  # owner -> ranks: construct an actor
    REDIRECT = 5  # caller -> rank: your parent died, reply to me instead
    NOT_RECEIVED = 6  # rank -> caller: a REDIRECT for a call I never saw
    STOP = 7  # owner -> rank: exit now
    DEATH = 8  # owner -> ranks: a rank of a mesh you may call has died
    FAILURE = 9  # rank -> mesh owner: an unobserved failure (supervision)
    PRUNE = 10  # caller -> rank: stop waiting for a child subtree whose root died
    WAKE = 11  # any -> a thread's inbox: an answer arrived another way; look again
    PORT = 12  # any -> the process that opened a port: one value for it
    INTERRUPT = 13  # caller -> rank: raise KeyboardInterrupt in an actor's running endpoint
    REVIVE = 14  # owner -> ranks: a dead rank was restarted in place
    HEARTBEAT = 15  # unused since beats travel through the template (template_wire.BEATS); kept for the wire
    HOST = 16  # controller <-> the agent of one of its hosts: one agent_wire message (msgpack)


class Mode(enum.IntEnum):
    GATHER = 0  # replies are merged on the way up the tree
    DIRECT = 1  # every rank replies straight to the origin (streams)


class Status(enum.IntEnum):
    OK = 0
    RAISED = 1  # the endpoint raised; payload is a pickled RemoteFailure
    DIED = 2  # the rank is gone (filled in by the caller, never sent)
    STOPPED = 3  # the mesh was stopped
    UNSENT = 4  # the call could not be sent to the rank (filled in by the caller: SendFailed)


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
    # Small typed values that need no pickle (pids, scalar args).
    extra: Any = None

    _FIELDS = (
        "kind", "call_id", "origin", "reply_to", "mesh", "actor", "method",
        "ranks", "fanout", "mode", "resend", "hop", "parts", "extra",
    )

    def encode(self) -> bytes:
        return _pack((self.kind, self.call_id, self.origin, self.reply_to, self.mesh, self.actor,
                      self.method, self.ranks, self.fanout, self.mode, self.resend, self.hop,
                      self.parts, self.extra))

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
        data, *bufs = (_buffer(f) for f in self.frames)
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
    header.parts = [[p.rank, p.status, len(p.frames) - 1] for p in parts]
    frames = []
    for p in parts:
        frames.extend(p.frames)
    return frames
