"""Who is running: the mesh and rank of this process, and the actor and message being served.

The actor layer reads these to answer ``current_rank()`` and ``context()``; the runtime sets
them.  Nothing here imports the rest of the runtime.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field


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
