"""The messages between a controller and what forks its ranks (its local template, or the
agent on one of its hosts): one small dataclass per kind, each with one msgpack encoding.

Decoding checks every field's type and raises ``MalformedMessage`` on anything else; nothing
here ever unpickles.  The framing is each transport's own (``template_channel``: datagrams with
file descriptors; ``agent_channel``: signed ``Kind.HOST`` messages).  Both sides import this
module, so it holds message shapes only, never either side's state.
"""

# No ``from __future__ import annotations``: the field types below are read at run time
# (``dataclasses.fields(cls)[i].type``) to check what arrives.

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import msgpack

M = TypeVar("M", bound="Message")


class MalformedMessage(ValueError):
    """Bytes that are not a message of this wire (a bug, or another program's data)."""


def _fits(value, tp) -> bool:
    """Whether a decoded msgpack ``value`` has the declared type ``tp``."""
    if tp is int:
        return type(value) is int  # not bool
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, t) for t in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is tuple:  # a fixed-length record inside a list (msgpack gives it back as a list)
        items = typing.get_args(tp)
        return isinstance(value, list | tuple) and len(value) == len(items) and all(map(_fits, value, items))
    return isinstance(value, tp)


def _at_default(f: dataclasses.Field, value) -> bool:
    if f.default is not dataclasses.MISSING:
        return type(value) is type(f.default) and value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


@dataclass(frozen=True)
class Message:
    """One message; on the wire ``[op, field, ...]`` in the order of the fields.  Trailing
    fields left at their defaults are not sent, so a field added with a default later is
    read by an older peer as long as the sender leaves it at that default."""

    OP: ClassVar[str] = ""

    def encode(self) -> bytes:
        fields = dataclasses.fields(self)
        values = [getattr(self, f.name) for f in fields]
        while values and _at_default(fields[len(values) - 1], values[-1]):
            values.pop()
        return msgpack.packb([self.OP, *values], use_bin_type=True)

    @classmethod
    def from_values(cls: type[M], values: list) -> M:
        fields = dataclasses.fields(cls)
        required = sum(1 for f in fields if f.default is dataclasses.MISSING
                       and f.default_factory is dataclasses.MISSING)
        if not required <= len(values) <= len(fields):
            raise MalformedMessage(f"{cls.OP!r} takes {len(fields)} fields "
                                   f"({', '.join(f.name for f in fields) or 'none'}); got {len(values)}")
        for f, v in zip(fields, values, strict=False):
            if not _fits(v, f.type):
                raise MalformedMessage(f"field {f.name!r} of {cls.OP!r} is {f.type!s}, "
                                       f"not {type(v).__name__} ({v!r:.80})")
        return cls(*values)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        """The message ``encode`` made, which must be of this class (``Message.decode``: any)."""
        msg = decode(data)
        if not isinstance(msg, cls):
            raise MalformedMessage(f"expected a {cls.OP!r} message, got {msg.OP!r}")
        return msg


# ---------------------------------------------------------------- controller -> template or agent


@dataclass(frozen=True)
class Fork(Message):
    """Fork one rank; answered by ``Forked`` or ``ForkFailed`` with the same tag.  ``config``
    is ``LaunchConfig.to_wire()``, decoded by the forked child (a bad one costs that rank).
    ``standby`` (agents; a restarted rank): from the agent's warm standby (``Warm``) if it
    has one ready, else from its template.  Sent only to an agent that answered a ``Warm``."""

    OP = "fork"
    tag: int
    config: dict
    standby: bool = False


@dataclass(frozen=True)
class Kill(Message):
    OP = "kill"
    pid: int
    signal: int


@dataclass(frozen=True)
class Reserve(Message):
    """(agents) Reserve ``n`` TCP ports for ranks' inboxes; answered by ``Ports``.  With
    ``check``, first see that the host holds ``n`` more ranks of ``rank_memory`` bytes each."""

    OP = "reserve"
    tag: int
    n: int
    check: bool = False
    rank_memory: int = 0


@dataclass(frozen=True)
class Stacks(Message):
    """``py-spy dump`` each of ``pids`` (ranks forked there); answered by one ``StackDump`` per pid."""

    OP = "stacks"
    tag: int
    pids: list[int]
    native: bool


@dataclass(frozen=True)
class Drain(Message):
    """(templates) Send what the ranks have written so far, then answer ``Drained``: at the
    controller's exit, so that a rank's last lines are shown before it is killed."""

    OP = "drain"
    tag: int


@dataclass(frozen=True)
class Usage(Message):
    """(agents) CPU ticks and resident memory of each of ``pids``; answered by ``Usages``."""

    OP = "usage"
    tag: int
    pids: list[int]


@dataclass(frozen=True)
class HistoryAsk(Message):
    """(agents) Send this host's history files of mesh ``mesh`` whose names are not in
    ``have``; answered by ``HistoryFile`` messages, the last with ``last`` set."""

    OP = "history_ask"
    tag: int
    mesh: str
    have: list[str]


@dataclass(frozen=True)
class Warm(Message):
    """(agents) Keep a standby template that holds the heavy modules the first of ``pids``
    (live ranks of one mesh there) has imported; restarted ranks fork from it.  Answered by
    ``Warmed``.  An agent that does not know it drops it, and never answers."""

    OP = "warm"
    pids: list[int]


@dataclass(frozen=True)
class Bye(Message):
    """(agents) End every rank and exit (``job.kill()``)."""

    OP = "bye"


# ---------------------------------------------------------------- template or agent -> controller


@dataclass(frozen=True)
class Ready(Message):
    """(templates, first) The template serves; ``nofile``: its open-files limit."""

    OP = "ready"
    nofile: int | None


@dataclass(frozen=True)
class Up(Message):
    """(agents, first) The agent serves, and says what it runs."""

    OP = "up"
    hostname: str
    pid: int
    ip: str
    python: str
    version: str


@dataclass(frozen=True)
class Ports(Message):
    """The ports asked for; or none, and why the host has no room for the ranks (``refused``,
    ``limit``: what runs out, ``fits``: how many more ranks it holds)."""

    OP = "ports"
    tag: int
    ports: list[int]
    refused: str = ""
    limit: str = ""
    fits: int = 0


@dataclass(frozen=True)
class Forked(Message):
    OP = "forked"
    tag: int
    pid: int


@dataclass(frozen=True)
class ForkFailed(Message):
    """The rank could not be made (a limit was reached); ``error`` says which and how to raise it."""

    OP = "fork_failed"
    tag: int
    error: str


@dataclass(frozen=True)
class Output(Message):
    """What ranks wrote, in the order it was read: ``[pid, fd (1 or 2), data]`` each."""

    OP = "output"
    items: list[tuple[int, int, bytes]]


@dataclass(frozen=True)
class Hello(Message):
    """A rank is up; ``hello`` is its ``RankHello``, encoded, passed on as it came."""

    OP = "hello"
    pid: int
    hello: bytes


@dataclass(frozen=True)
class Beats(Message):
    """The ranks that beat since the last ``Beats``."""

    OP = "beats"
    pids: list[int]


@dataclass(frozen=True)
class StackDump(Message):
    """What py-spy said of one rank: its exit ``status`` (-1: it could not run), its JSON
    ``out`` and the tail of its ``err``."""

    OP = "stack_dump"
    tag: int
    pid: int
    status: int
    out: bytes
    err: bytes


@dataclass(frozen=True)
class Usages(Message):
    """``[pid, CPU ticks, resident bytes, GPU %, GPU MiB, CPU wanted ns, threads runnable]``
    each (-1: the process is gone, it uses no GPU, or its host keeps no ``schedstat``)."""

    OP = "usages"
    tag: int
    items: list[tuple[int, int, int, int, int, int, int]]


@dataclass(frozen=True)
class HistoryFile(Message):
    """One history file of the host's folder ``host`` (``name``, its bytes); the last message
    of an answer has ``last`` set and no file, and ``error`` when the files could not be read."""

    OP = "history_file"
    tag: int
    host: str
    name: str
    data: bytes
    last: bool
    error: str = ""


@dataclass(frozen=True)
class Warmed(Message):
    """The modules the agent's standby template holds, imported and ready to fork from
    (none while it is still importing them, or when it could not)."""

    OP = "warmed"
    modules: list[str]


@dataclass(frozen=True)
class Drained(Message):
    """Every byte the ranks had written when ``Drain`` arrived was sent before this."""

    OP = "drained"
    tag: int


@dataclass(frozen=True)
class Exit(Message):
    """A rank was reaped; ``status`` as ``os.waitpid`` gives it."""

    OP = "exit"
    pid: int
    status: int


# ---------------------------------------------------------------- both ways, and rank -> template


@dataclass(frozen=True)
class Beat(Message):
    """(agents, both ways, every ``agent_channel.BEAT_S``) Still here."""

    OP = "beat"


@dataclass(frozen=True)
class RankHello(Message):
    """What a rank says on its control pipe once its bootstrap ran: its mesh and rank, and,
    when the bootstrap raised, that part (``failed_status``, ``failed_frames``)."""

    OP = "rank_hello"
    mesh: str
    rank: int
    pid: int
    failed_status: int | None = None
    failed_frames: list[bytes] = field(default_factory=list)


OPS: dict[str, type[Message]] = {cls.OP: cls for cls in (
    Fork, Kill, Reserve, Stacks, Drain, Usage, Bye, Ready, Up, Ports, Forked, ForkFailed, Output, Hello, Beats,
    StackDump, Usages, Drained, Exit, Beat, RankHello, HistoryAsk, HistoryFile, Warm, Warmed)}


def decode(data: bytes) -> Message:
    """The message in ``data``; ``MalformedMessage`` (saying what is wrong) for anything else."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:  # msgpack's errors are ValueErrors; an unhashable map key, TypeError
        raise MalformedMessage(f"not a msgpack message: {e}") from None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MalformedMessage(f"a message is a msgpack list [op, field, ...]; got {raw!r:.80}")
    cls = OPS.get(raw[0])
    if cls is None:
        raise MalformedMessage(f"unknown op {raw[0]!r:.40} (known: {', '.join(OPS)})")
    return cls.from_values(raw[1:])
