"""Who is running: the mesh and rank of this process, and the actor and message being served.

The actor layer reads these to answer ``current_rank()`` and ``context()``; the runtime sets
them.  Nothing here imports the rest of the runtime.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class MeshRef:
    """A picklable reference to a proc mesh: enough to call any of its ranks directly."""

    id: str
    name: str
    dims: tuple  # ((label, size), ...) in row-major order
    addresses: tuple  # inbox address of each rank
    owner: str  # inbox of the process that spawned (and supervises) it
    hosts: tuple = field(default=())

    @property
    def size(self) -> int:
        return len(self.addresses)

    def moved(self, rank: int, address: str, host: str) -> MeshRef:
        """This reference with ``rank`` at ``address`` on ``host`` (restarted on another host).

        >>> ref = MeshRef("m1", "g", (("g", 2),), ("tcp://a:1", "tcp://a:2"), "tcp://c:3", ("a", "a"))
        >>> ref.moved(1, "tcp://b:4", "b").addresses, ref.moved(1, "tcp://b:4", "b").hosts
        (('tcp://a:1', 'tcp://b:4'), ('a', 'b'))
        """
        addresses, hosts = list(self.addresses), list(self.hosts)
        addresses[rank] = address
        if rank < len(hosts):
            hosts[rank] = host
        return replace(self, addresses=tuple(addresses), hosts=tuple(hosts))

    def to_wire(self) -> list:
        """This reference as plain lists and strings, for msgpack or JSON.

        >>> ref = MeshRef("m1", "gpus", (("gpus", 2),), ("ipc:///r/m1.0", "ipc:///r/m1.1"), "ipc:///r/c", ("h", "h"))
        >>> MeshRef.from_wire(ref.to_wire()) == ref
        True
        """
        return [self.id, self.name, [list(d) for d in self.dims], list(self.addresses), self.owner,
                list(self.hosts)]

    @classmethod
    def from_wire(cls, fields) -> MeshRef:
        """The reference ``to_wire()`` encoded (msgpack and JSON give lists back for tuples)."""
        if not isinstance(fields, (list, tuple)) or len(fields) != 6:
            raise ValueError(f"a mesh reference on the wire is [id, name, dims, addresses, owner, hosts]; "
                             f"got {fields!r:.200}")
        mesh_id, name, dims, addresses, owner, hosts = fields
        return cls(mesh_id, name, tuple(tuple(d) for d in dims), tuple(addresses), owner, tuple(hosts))


@dataclass
class ActorContext:
    """The actor whose endpoint (or ``__init__``) is running in this task or thread."""

    mesh: MeshRef
    rank: int
    actor: str
    instance: object
    message_rank: int | None = None  # rank index of the message within the called slice
    message_dims: tuple | None = None  # dims of the called slice; None: unknown


# Set for the whole process in ranks; the controller's own mesh otherwise.
process_mesh: list = [None, 0]  # [MeshRef | None, rank]
current_actor: contextvars.ContextVar[ActorContext | None] = contextvars.ContextVar(
    "monarch_kernel_actor", default=None
)


def new_actor_id(name: str) -> str:
    """A unique id for an actor mesh the user named ``name`` (``trainers`` ->
    ``trainers-1a2b3c``); ``actor_name`` gives the name back."""
    import secrets

    return f"{name}-{secrets.token_hex(3)}"


def actor_name(actor_id: str) -> str:
    """The name the user gave an actor mesh: its id without the suffix ``new_actor_id``
    added (ids made otherwise, ``"bootstrap"`` say, are their own name)."""
    name, sep, suffix = actor_id.rpartition("-")
    if sep and len(suffix) == 6 and all(c in "0123456789abcdef" for c in suffix):
        return name
    return actor_id


def point_text(rank: int, dims) -> str:
    """Rank ``rank`` of ``dims`` as Monarch prints a point: ``{'hosts': 1/2, 'gpus': 1/4}``."""
    coords = []
    for label, size in reversed(tuple(dims)):
        coords.append(f"{label!r}: {rank % size}/{size}")
        rank //= size
    return "{" + ", ".join(reversed(coords)) + "}"


def actor_display(class_name: str, actor_id: str, rank: int, dims) -> str:
    """One actor as Monarch names it in reports: ``<module.Class name{point}>``."""
    what = f"{class_name} " if class_name else ""
    return f"<{what}{actor_name(actor_id)}{point_text(rank, dims)}>"


def actor_path(parent: ActorContext | None, class_name: str, actor_id: str, rank: int, dims) -> str:
    """Where an actor sits, as Monarch's reports say: ``<root>.<mod.Parent p{...}>.<mod.Child c{...}>``
    (``parent``: the actor that spawned its mesh; None: the controller, ``<root>``)."""
    head = "<root>"
    if parent is not None:
        cls = type(parent.instance)
        head += "." + actor_display(f"{cls.__module__}.{cls.__qualname__}", parent.actor, parent.rank,
                                    parent.mesh.dims)
    return f"{head}.{actor_display(class_name, actor_id, rank, dims)}"
