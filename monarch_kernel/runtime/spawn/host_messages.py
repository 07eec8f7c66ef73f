"""The messages between a controller and what forks its ranks (its local template, or the
agent on one of its hosts): one small frozen record class per kind, each with one msgpack
encoding.

Decoding checks every field's type and raises ``MalformedMessage`` on anything else; nothing
here ever unpickles.  The framing is each transport's own (``template_channel``: datagrams with
file descriptors; ``agent_channel``: signed ``Kind.HOST`` messages).  Both sides import this
module, so it holds message shapes only, never either side's state.

The classes are not dataclasses: every process that forks or talks to ranks (the controller,
each template, each agent) imports them at start-up, and 25 frozen dataclasses cost over 30 ms
there (each generates its methods through ``exec``).  ``Message`` reads a subclass's
annotations once, and its methods serve them all.
"""

# No ``from __future__ import annotations``: the field types below are read at run time
# (``cls.FIELDS[i].type``) to check what arrives.

import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import msgpack

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:
    def dataclass_transform(**_):  # it tells type checkers only: nothing to do at run time
        return lambda cls: cls

M = TypeVar("M", bound="Message")


class MalformedMessage(ValueError):
    """Bytes that are not a message of this wire (a bug, or another program's data)."""


_MISSING: Any = object()


class Field(NamedTuple):
    """One field of a message class: its name, its type, and its default (or a factory)."""

    name: str
    type: Any
    default: Any = _MISSING
    default_factory: Callable[[], Any] | None = None

    def required(self) -> bool:
        return self.default is _MISSING and self.default_factory is None


class _Factory(NamedTuple):
    default_factory: Callable[[], Any]


def field(*, default_factory: Callable[[], Any]) -> Any:
    """A field whose default is made anew for each message (``field(default_factory=list)``)."""
    return _Factory(default_factory)


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


def _at_default(f: Field, value) -> bool:
    if f.default is not _MISSING:
        return type(value) is type(f.default) and value == f.default
    if f.default_factory is not None:
        return value == f.default_factory()
    return False


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
class Message:
    """One message; on the wire ``[op, field, ...]`` in the order of the fields.  Trailing
    fields left at their defaults are not sent, so a field added with a default later is
    read by an older peer as long as the sender leaves it at that default.

    A subclass declares its fields as annotations (a default after ``=``), as a dataclass
    would; its instances are frozen, compared and hashed by type and values."""

    OP: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[Field, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        fields = list(cls.FIELDS)
        for name, tp in cls.__dict__.get("__annotations__", {}).items():
            if typing.get_origin(tp) is ClassVar:
                continue
            given = cls.__dict__.get(name, _MISSING)
            if isinstance(given, _Factory):
                fields.append(Field(name, tp, default_factory=given.default_factory))
                delattr(cls, name)
            else:
                fields.append(Field(name, tp, given))
            if fields[-1].required() and any(not f.required() for f in fields[:-1]):
                raise TypeError(f"{cls.__name__}.{name}: a field without a default follows one with a default")
        cls.FIELDS = tuple(fields)

    def __init__(self, *args, **kwargs) -> None:
        fields = self.FIELDS
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes {len(fields)} fields, got {len(args)}")
        if unknown := set(kwargs).difference(f.name for f in fields):
            raise TypeError(f"{type(self).__name__} has no field {', '.join(map(repr, sorted(unknown)))}")
        set_field = object.__setattr__
        for f, v in zip(fields, args, strict=False):
            if f.name in kwargs:
                raise TypeError(f"{type(self).__name__} got field {f.name!r} twice")
            set_field(self, f.name, v)
        for f in fields[len(args):]:
            if f.name in kwargs:
                v = kwargs.pop(f.name)
            elif f.default is not _MISSING:
                v = f.default
            elif f.default_factory is not None:
                v = f.default_factory()
            else:
                raise TypeError(f"{type(self).__name__} needs field {f.name!r}")
            set_field(self, f.name, v)

    def values(self) -> tuple:
        """The fields' values, in order."""
        return tuple(getattr(self, f.name) for f in self.FIELDS)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a {type(self).__name__} message is frozen: make a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a {type(self).__name__} message is frozen: make a new one")

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.values() == other.values()

    def __hash__(self) -> int:
        return hash((type(self), self.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in self.FIELDS)})"

    def encode(self) -> bytes:
        fields = self.FIELDS
        values = list(self.values())
        while values and _at_default(fields[len(values) - 1], values[-1]):
            values.pop()
        return msgpack.packb([self.OP, *values], use_bin_type=True)

    @classmethod
    def from_values(cls: type[M], values: list) -> M:
        fields = cls.FIELDS
        required = sum(1 for f in fields if f.required())
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


class Fork(Message):
    """Fork one rank; answered by ``Forked`` or ``ForkFailed`` with the same tag.  ``config``
    is ``LaunchConfig.to_wire()``, decoded by the forked child (a bad one costs that rank).
    ``standby`` (agents; a restarted rank): from the agent's warm standby (``Warm``) if it
    has one ready, else from its template.  Sent only to an agent that answered a ``Warm``."""

    OP = "fork"
    tag: int
    config: dict
    standby: bool = False


class Kill(Message):
    OP = "kill"
    pid: int
    signal: int


class Reserve(Message):
    """(agents) Reserve ``n`` TCP ports for ranks' inboxes; answered by ``Ports``.  With
    ``check``, first see that the host holds ``n`` more ranks of ``rank_memory`` bytes each."""

    OP = "reserve"
    tag: int
    n: int
    check: bool = False
    rank_memory: int = 0


class Stacks(Message):
    """``py-spy dump`` each of ``pids`` (ranks forked there); answered by one ``StackDump`` per pid."""

    OP = "stacks"
    tag: int
    pids: list[int]
    native: bool


class Drain(Message):
    """(templates, agents) Send what the ranks have written so far, then answer ``Drained``:
    at the end of a notebook cell, so that what a rank printed before answering the cell's
    calls shows in that cell, and at the controller's exit, before the ranks are killed."""

    OP = "drain"
    tag: int


class Usage(Message):
    """(agents) CPU ticks and resident memory of each of ``pids``; answered by ``Usages``."""

    OP = "usage"
    tag: int
    pids: list[int]


class HistoryAsk(Message):
    """(agents) Send this host's history files of mesh ``mesh`` whose names are not in
    ``have``; answered by ``HistoryFile`` messages, the last with ``last`` set."""

    OP = "history_ask"
    tag: int
    mesh: str
    have: list[str]


class Warm(Message):
    """(agents) Keep a standby template that holds the heavy modules the first of ``pids``
    (live ranks of one mesh there) has imported; restarted ranks fork from it.  Answered by
    ``Warmed``.  An agent that does not know it drops it, and never answers."""

    OP = "warm"
    pids: list[int]


class Bye(Message):
    """(agents) End every rank and exit (``job.kill()``)."""

    OP = "bye"


# ---------------------------------------------------------------- template or agent -> controller


class Ready(Message):
    """(templates, first) The template serves; ``nofile``: its open-files limit."""

    OP = "ready"
    nofile: int | None


class Up(Message):
    """(agents, first) The agent serves, and says what it runs."""

    OP = "up"
    hostname: str
    pid: int
    ip: str
    python: str
    version: str


class Ports(Message):
    """The ports asked for; or none, and why the host has no room for the ranks (``refused``,
    ``limit``: what runs out, ``fits``: how many more ranks it holds)."""

    OP = "ports"
    tag: int
    ports: list[int]
    refused: str = ""
    limit: str = ""
    fits: int = 0


class Forked(Message):
    OP = "forked"
    tag: int
    pid: int


class ForkFailed(Message):
    """The rank could not be made (a limit was reached); ``error`` says which and how to raise it."""

    OP = "fork_failed"
    tag: int
    error: str


class Output(Message):
    """What ranks wrote, in the order it was read: ``[pid, fd (1 or 2), data]`` each."""

    OP = "output"
    items: list[tuple[int, int, bytes]]


class Hello(Message):
    """A rank is up; ``hello`` is its ``RankHello``, encoded, passed on as it came."""

    OP = "hello"
    pid: int
    hello: bytes


class Beats(Message):
    """The ranks that beat since the last ``Beats``."""

    OP = "beats"
    pids: list[int]


class StackDump(Message):
    """What py-spy said of one rank: its exit ``status`` (-1: it could not run), its JSON
    ``out`` and the tail of its ``err``."""

    OP = "stack_dump"
    tag: int
    pid: int
    status: int
    out: bytes
    err: bytes


class Usages(Message):
    """``[pid, CPU ticks, resident bytes, GPU %, GPU MiB, CPU wanted ns, threads runnable]``
    each (-1: the process is gone, it uses no GPU, or its host keeps no ``schedstat``)."""

    OP = "usages"
    tag: int
    items: list[tuple[int, int, int, int, int, int, int]]


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


class Warmed(Message):
    """The modules the agent's standby template holds, imported and ready to fork from
    (none while it is still importing them, or when it could not)."""

    OP = "warmed"
    modules: list[str]


class Drained(Message):
    """Every byte the ranks had written when ``Drain`` arrived was sent before this."""

    OP = "drained"
    tag: int


class Exit(Message):
    """A rank was reaped; ``status`` as ``os.waitpid`` gives it."""

    OP = "exit"
    pid: int
    status: int


# ---------------------------------------------------------------- both ways, and rank -> template


class Beat(Message):
    """(agents, both ways, every ``agent_channel.BEAT_S``) Still here."""

    OP = "beat"


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
