"""The typed payload each message kind carries in its header, beside the routing fields.

Each is a small NamedTuple that msgpack packs as an array, with a ``decode`` that checks the
shape and types of what arrived (from another process: untrusted until the MAC is checked,
and never unpickled).  ``PAYLOADS`` maps a kind to its type; a kind absent from it carries
none.  Routing never looks inside a payload; each kind's handler does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .kinds import Kind


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _flat(v, types: tuple, what: str) -> list:
    """``v`` if it is a list of exactly ``types`` (a flat payload), else ValueError(``what``)."""
    if not (isinstance(v, list) and len(v) == len(types) and all(type(x) is t for x, t in zip(v, types, strict=True))):
        raise ValueError(f"{what} is malformed")
    return v


class CallInfo(NamedTuple):
    """CALL: the slice that was called (its dims and its ranks, in the mesh's numbering), so
    that a rank knows its point in it; ``broadcast``: nobody waits for the answers."""

    dims: tuple
    ranks: tuple
    broadcast: bool = False

    @classmethod
    def decode(cls, v) -> CallInfo:
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], list) and _ints(v[1])
                and type(v[2]) is bool):
            raise ValueError("a CALL's slice info is malformed")
        for d in v[0]:
            if not (isinstance(d, list) and len(d) == 2 and type(d[0]) is str and type(d[1]) is int):
                raise ValueError("a CALL's slice dims are malformed")
        return cls(tuple((d[0], d[1]) for d in v[0]), tuple(v[1]), v[2])

    def point(self, rank: int) -> tuple[int, tuple | None]:
        """(this rank's flat index within the slice, the slice's dims)."""
        try:
            return self.ranks.index(rank), self.dims
        except ValueError:
            return rank, None


class SpawnInfo(NamedTuple):
    """SPAWN: options of the actor being constructed."""

    main_thread: bool = False  # it asked for the rank's main thread (Actor.runs_on_main_thread)

    @classmethod
    def decode(cls, v) -> SpawnInfo:
        return cls(*_flat(v, (bool,), "a SPAWN's options"))


class ReplyInfo(NamedTuple):
    """REPLY from an actor on another host that has a TCP inbox of its own: callers send its
    later calls straight there."""

    actor: str
    address: str

    @classmethod
    def decode(cls, v) -> ReplyInfo:
        actor, address = _flat(v, (str, str), "a REPLY's direct address")
        if not address.startswith("tcp://"):
            raise ValueError("a REPLY's direct address is not a TCP address")
        return cls(actor, address)


class PruneInfo(NamedTuple):
    """PRUNE: stop waiting for the subtree whose root ``rank`` died."""

    rank: int

    @classmethod
    def decode(cls, v) -> PruneInfo:
        return cls(*_flat(v, (int,), "a PRUNE"))


class DeathNotice(NamedTuple):
    """DEATH: a rank of mesh ``mesh`` died (the header's mesh is the one it is sent down);
    the DeathInfo travels pickled in the body."""

    mesh: str

    @classmethod
    def decode(cls, v) -> DeathNotice:
        return cls(*_flat(v, (str,), "a DEATH notice"))


class ReviveNotice(NamedTuple):
    """REVIVE: ``rank`` of mesh ``mesh`` was restarted in place; forget its death."""

    mesh: str
    rank: int

    @classmethod
    def decode(cls, v) -> ReviveNotice:
        return cls(*_flat(v, (str, int), "a REVIVE notice"))


class MovedNotice(NamedTuple):
    """MOVED: ``rank`` of mesh ``mesh``, once at ``old``, was restarted on ``host`` at ``new``
    (its own host was gone); what is sent to ``old`` goes to ``new`` from now on."""

    mesh: str
    rank: int
    old: str
    new: str
    host: str

    @classmethod
    def decode(cls, v) -> MovedNotice:
        notice = cls(*_flat(v, (str, int, str, str, str), "a MOVED notice"))
        if not (notice.old.startswith("tcp://") and notice.new.startswith("tcp://")):
            raise ValueError("a MOVED notice's addresses are not TCP addresses")
        return notice


class InterruptAck(NamedTuple):
    """INTERRUPT: the port (at ``address``) to tell once it has landed."""

    address: str
    port: int

    @classmethod
    def decode(cls, v) -> InterruptAck:
        return cls(*_flat(v, (str, int), "an INTERRUPT's acknowledgement port"))


class StacksAsk(NamedTuple):
    """STACKS: the port (at ``address``) that hears the rank's own dump of its threads."""

    address: str
    port: int

    @classmethod
    def decode(cls, v) -> StacksAsk:
        return cls(*_flat(v, (str, int), "a STACKS answer port"))


PAYLOADS: dict[int, Any] = {
    Kind.CALL: CallInfo,
    Kind.SPAWN: SpawnInfo,
    Kind.REPLY: ReplyInfo,
    Kind.PRUNE: PruneInfo,
    Kind.DEATH: DeathNotice,
    Kind.REVIVE: ReviveNotice,
    Kind.MOVED: MovedNotice,
    Kind.INTERRUPT: InterruptAck,
    Kind.STACKS: StacksAsk,
}


def decode_payload(kind: int, raw):
    """The typed payload of a message of ``kind`` (None when it carries none); ValueError
    when it is not what that kind carries."""
    if raw is None:
        return None
    cls = PAYLOADS.get(kind)
    if cls is None:
        raise ValueError(f"a {Kind(kind).name if kind in Kind._value2member_map_ else kind} carries no payload")
    return cls.decode(raw)
