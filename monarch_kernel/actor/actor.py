"""``Actor`` and the questions code running on a rank asks: ``current_rank()``,
``current_size()``, ``context()``.

Example::

    class Counter(Actor):
        def __init__(self, start: int):
            self.value = start
        @endpoint
        def incr(self) -> int:
            self.value += 1
            return self.value
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mesh.shape import Extent, Point
from ..runtime.context import current_actor, process_mesh


class Actor:
    """Base class of actors.  Define ``__supervise__(self, failure)`` (sync or async,
    truthy = handled) to decide what happens when a mesh this actor spawned fails."""

    #: Run this actor's sync endpoints on the rank's main thread, where an interrupt is a
    #: real SIGINT that cuts blocking calls short.  One actor per rank gets it (the first to
    #: be spawned); others, and actors hosted by the controller, keep a thread of their own.
    runs_on_main_thread: bool = False


@dataclass
class ActorInstance:
    rank: Point
    actor_id: str
    proc_id: str
    instance: object


@dataclass
class Context:
    actor_instance: ActorInstance
    message_rank: Point


def _extent(dims) -> Extent:
    return Extent(tuple(dims))


def current_rank() -> Point:
    """The calling rank's point in its proc mesh (rank 0 of an empty extent on the controller)."""
    ctx = current_actor.get()
    if ctx is not None:
        return Point.from_rank(ctx.rank, _extent(ctx.mesh.dims))
    mesh, rank = process_mesh
    if mesh is None:
        return Point((), Extent(()))
    return Point.from_rank(rank, _extent(mesh.dims))


def current_size() -> dict:
    """``{dim: size}`` of the calling rank's proc mesh."""
    ctx = current_actor.get()
    mesh = ctx.mesh if ctx is not None else process_mesh[0]
    return dict(mesh.dims) if mesh is not None else {}


def context() -> Context:
    """The actor and message being served (outside an endpoint: the process itself)."""
    ctx = current_actor.get()
    if ctx is None:
        p = current_rank()
        mesh = process_mesh[0]
        return Context(ActorInstance(p, "", mesh.id if mesh else "", None), p)
    extent = _extent(ctx.mesh.dims)
    rank = Point.from_rank(ctx.rank, extent)
    if ctx.message_dims is not None and ctx.message_rank is not None:  # set together
        msg = Point.from_rank(ctx.message_rank, _extent(ctx.message_dims))
    else:
        msg = rank
    return Context(ActorInstance(rank, ctx.actor, ctx.mesh.id, ctx.instance), msg)
