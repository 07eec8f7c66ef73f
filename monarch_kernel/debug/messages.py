"""What the debugger and distributed pdb send between the kernel and ranks, as typed classes.

Used in the kernel and on ranks alike.  Each class has one ``encode()`` (plain dicts, lists,
strings and numbers: what goes on the wire) and one ``decode()`` back; nothing here does
I/O, and a malformed pdb message is a ``ValueError``, never a guess.

pdb, rank -> kernel (the pdb hub's port): ``Stopped``, ``Prompt``, ``Resumed``, ``Ended``;
kernel -> rank (the session's reply port): ``Reply``.  DAP, kernel <-> a rank's debugpy
(framed by ``dap.py``): ``DapRequest``, ``DapResponse``, ``DapEvent``; the tunnel that
carries them (``relay.py`` -> the kernel's port): ``DapFrames``, ``DapClosed``; and where a
rank runs (``RankHost``).

>>> Prompt.decode(Prompt("m", 1, 2, "> x\\n").encode()) == Prompt("m", 1, 2, "> x\\n")
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..actor.port import Port

RELEASE = "\x00release"  # a Reply's line in place of a typed one: nobody will answer, run on


def _int(v) -> int:
    """A DAP sequence number as sent, or 0 for anything that is not an int (so a bad one
    matches no request)."""
    return v if type(v) is int else 0


def _obj(v) -> dict | None:
    return v if isinstance(v, dict) else None


def _fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _check(cls, obj, kind: str) -> dict:
    """``obj`` as the fields of ``cls``, or a ValueError saying what is wrong with it."""
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        got = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"expected a {kind!r} message, got {got!r}")
    names = _fields(cls)
    missing = [n for n in names if n not in obj]
    extra = sorted(set(obj) - set(names) - {"kind"})
    if missing or extra:
        raise ValueError(f"a {kind!r} message has fields {list(names)}; "
                         f"missing {missing}, unexpected {extra}")
    values = {n: obj[n] for n in names}
    for f in dataclasses.fields(cls):
        allowed = _WIRE_TYPES.get(f.type) if isinstance(f.type, str) else None
        v = values[f.name]
        if allowed is not None and (not isinstance(v, allowed) or (type(v) is bool and bool not in allowed)):
            raise ValueError(f"field {f.name!r} of a {kind!r} message is {f.type}, not {type(v).__name__}")
    return values


# What each annotation (a string: this module's annotations are not evaluated) may be on the
# wire, as JSON-like values; an int field never takes a bool.
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "bool": (bool,), "tuple": (list, tuple), "list": (list,), "dict": (dict,),
    "str | None": (str, type(None)), "Port | None": (list, tuple, type(None)),
}


class _PdbMessage:
    """encode/decode for the pdb messages whose fields are plain values already."""

    KIND: ClassVar[str] = ""

    def encode(self) -> dict:
        return {"kind": self.KIND, **{n: getattr(self, n) for n in _fields(self)}}

    @classmethod
    def decode(cls, obj):
        return cls(**_check(cls, obj, cls.KIND))


@dataclass
class Stopped:
    """A session began: where, and which files the rank has no source for."""

    KIND: ClassVar[str] = "pdb.stopped"

    mesh: str
    rank: int
    session: int
    filename: str
    lineno: int
    function: str
    reason: str  # "breakpoint" or "post-mortem"
    cell: bool  # the frame is a %%mesh cell run on this rank
    error: str = ""  # for post-mortem: the exception, one line
    missing: tuple = ()
    reply: Port | None = None  # where the kernel sends each Reply

    def encode(self) -> dict:
        out = {"kind": self.KIND, **{n: getattr(self, n) for n in _fields(self)}}
        out["missing"] = list(self.missing)
        r = self.reply
        out["reply"] = None if r is None else [r.address, r.port_id, r.rank]
        return out

    @classmethod
    def decode(cls, obj) -> Stopped:
        values = _check(cls, obj, cls.KIND)
        values["missing"] = tuple(values["missing"])
        if values["reply"] is not None:
            reply = values["reply"]
            if not (len(reply) == 3 and type(reply[0]) is str and type(reply[1]) is int and type(reply[2]) is int):
                raise ValueError(f"a 'pdb.stopped' message's reply port is [address, port, rank], not {reply!r:.80}")
            values["reply"] = Port(*reply)
        return cls(**values)


@dataclass
class Prompt(_PdbMessage):
    """The rank waits for a pdb command; ``output`` is what pdb printed since the last one."""

    KIND: ClassVar[str] = "pdb.prompt"

    mesh: str
    rank: int
    session: int
    output: str
    lineno: int = 0
    filename: str = ""


@dataclass
class Resumed(_PdbMessage):
    """The rank runs again: ``stepping`` if it will stop again by itself (n, s, r, unt)."""

    KIND: ClassVar[str] = "pdb.resumed"

    mesh: str
    rank: int
    session: int
    output: str
    stepping: bool


@dataclass
class Ended(_PdbMessage):
    """The session is over (the code it stopped returned, or the user quit)."""

    KIND: ClassVar[str] = "pdb.ended"

    mesh: str
    rank: int
    session: int
    output: str = ""


@dataclass
class Reply(_PdbMessage):
    """The kernel's answer to a rank: the line the user typed (None: EOF; ``RELEASE``: run
    on) and, after ``Stopped``, the sources the rank lacked (file name -> text)."""

    KIND: ClassVar[str] = "pdb.reply"

    line: str | None
    sources: dict = field(default_factory=dict)


RANK_MESSAGES = {cls.KIND: cls for cls in (Stopped, Prompt, Resumed, Ended)}


def decode(obj) -> Stopped | Prompt | Resumed | Ended:
    """A message a rank sent to the pdb hub."""
    cls = RANK_MESSAGES.get(str(obj.get("kind"))) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"not a pdb message from a rank: {obj!r:.200}")
    return cls.decode(obj)


# ---------------------------------------------------------------- DAP envelopes
#
# debugpy is someone else's peer: decoding tolerates fields the spec makes optional and
# ignores ones it adds, and the body stays the spec's own dict.


@dataclass
class DapRequest:
    KIND: ClassVar[str] = "request"

    seq: int
    command: str
    arguments: dict | None = None

    def encode(self) -> dict:
        out: dict[str, Any] = {"seq": self.seq, "type": self.KIND, "command": self.command}
        if self.arguments is not None:
            out["arguments"] = self.arguments
        return out

    @classmethod
    def decode(cls, msg: dict) -> DapRequest:
        return cls(_int(msg.get("seq")), str(msg.get("command", "")), _obj(msg.get("arguments")))


@dataclass
class DapResponse:
    KIND: ClassVar[str] = "response"

    request_seq: int
    command: str
    success: bool = True
    body: dict | None = None
    message: str = ""
    seq: int = 0

    def encode(self) -> dict:
        out: dict[str, Any] = {"type": self.KIND, "seq": self.seq, "request_seq": self.request_seq,
                               "success": self.success, "command": self.command}
        if self.body is not None:
            out["body"] = self.body
        if self.message:
            out["message"] = self.message
        return out

    @classmethod
    def decode(cls, msg: dict) -> DapResponse:
        return cls(_int(msg.get("request_seq")), str(msg.get("command", "")), msg.get("success") is True,
                   _obj(msg.get("body")), str(msg.get("message", "")), _int(msg.get("seq")))


@dataclass
class DapEvent:
    KIND: ClassVar[str] = "event"

    event: str
    body: dict | None = None
    seq: int = 0

    def encode(self) -> dict:
        out: dict[str, Any] = {"seq": self.seq, "type": self.KIND, "event": self.event}
        if self.body is not None:
            out["body"] = self.body
        return out

    @classmethod
    def decode(cls, msg: dict) -> DapEvent:
        return cls(str(msg.get("event", "")), _obj(msg.get("body")), _int(msg.get("seq")))


DAP_MESSAGES = {cls.KIND: cls for cls in (DapRequest, DapResponse, DapEvent)}


def decode_dap(msg: dict) -> DapRequest | DapResponse | DapEvent | None:
    """A DAP message by its ``type``; None for a type the spec does not have."""
    cls = DAP_MESSAGES.get(str(msg.get("type"))) if isinstance(msg, dict) else None
    return cls.decode(msg) if cls is not None else None


# ---------------------------------------------------------------- the DAP tunnel
#
# The kernel never connects to a rank's debugpy: the rank's relay does, on the rank's own
# loopback, and sends what debugpy says to a port of the kernel's.


@dataclass
class DapFrames(_PdbMessage):
    """The DAP messages one read from a rank's debugpy produced, in order (relay -> kernel)."""

    KIND: ClassVar[str] = "dap.frames"

    link: int
    messages: list


@dataclass
class DapClosed(_PdbMessage):
    """The relay's connection to debugpy ended (sent after its last ``DapFrames``)."""

    KIND: ClassVar[str] = "dap.closed"

    link: int
    reason: str


TUNNEL_MESSAGES = {cls.KIND: cls for cls in (DapFrames, DapClosed)}


def decode_tunnel(obj) -> DapFrames | DapClosed:
    """A message a rank's relay sent to the kernel's tunnel port."""
    cls = TUNNEL_MESSAGES.get(str(obj.get("kind"))) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"not a DAP tunnel message from a rank: {obj!r:.200}")
    return cls.decode(obj)


@dataclass
class RankHost:
    """Where a rank runs: its host name, its host identity (boot id and network namespace,
    as ``runtime.net.hosts.host_key``) and its IPv4 addresses, loopback last."""

    KIND: ClassVar[str] = "rank.host"

    hostname: str
    host_key: str
    addresses: tuple = ()

    def encode(self) -> dict:
        return {"kind": self.KIND, "hostname": self.hostname, "host_key": self.host_key,
                "addresses": list(self.addresses)}

    @classmethod
    def decode(cls, obj) -> RankHost:
        values = _check(cls, obj, cls.KIND)
        values["addresses"] = tuple(values["addresses"])
        return cls(**values)

