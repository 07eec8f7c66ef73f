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

import functools
import logging
from dataclasses import dataclass

from ..runtime import MeshRef, Runtime, current_actor, process_mesh
from . import tensor_shim
from .endpoint import endpoint
from .host_mesh import this_proc
from .proc_mesh import ProcMesh
from .shape import Extent, Point


class Actor:
    """Base class of actors.  Define ``__supervise__(self, failure)`` (sync or async,
    truthy = handled) to decide what happens when a mesh this actor spawned fails.

    Example::

        class Counter(Actor):
            def __init__(self, start: int):
                self.n = start
            @endpoint
            def incr(self) -> int:
                self.n += 1
                return self.n

        counters = procs.spawn("counters", Counter, 0)
        counters.incr.call().get()                  # ValueMesh: 1 on every rank
    """

    #: Run this actor's sync endpoints on the rank's main thread, where an interrupt is a
    #: real SIGINT that cuts blocking calls short.  One actor per rank gets it (the first to
    #: be spawned); others, and actors hosted by the controller, keep a thread of their own.
    runs_on_main_thread: bool = False

    @endpoint
    def __monarch_rref__(self, key: str, method: str, out, args, kwargs) -> None:
        """``rref``: run endpoint ``method`` here and keep its result on this rank, as the
        distributed tensors ``out`` of the proc mesh's tensor engine ``key``."""
        tensor_shim.tensors().keep_result(self, key, method, out, args, kwargs)

    @functools.cached_property
    def logger(self) -> logging.Logger:
        """A logger named after the actor's class, open to every level (as Monarch's); on a
        rank its records reach the controller as any logger's do: WARNING and up, or the
        level ``procs.logging_option(level=...)`` sets, with Monarch's ``[actor=...]``."""
        lgr = logging.getLogger(type(self).__name__)
        lgr.setLevel(logging.DEBUG)
        return lgr


@dataclass
class ActorInstance:
    rank: Point
    actor_id: str
    proc_id: str
    instance: object
    mesh: MeshRef | None = None  # the proc mesh the actor runs on

    @property
    def proc_mesh(self) -> ProcMesh:
        """The ProcMesh this actor was spawned on (the controller's own process outside one)."""
        return ProcMesh.from_ref(self.mesh) if self.mesh is not None else this_proc()

    def abort(self, reason: str = "") -> None:
        """Fail this actor with ``reason``, as Monarch's: its supervisor (the owner of
        its mesh, else ``unhandled_fault_hook``) gets a supervision event carrying it, later
        calls fail with it, and once the current message ends its concurrent endpoints are
        cancelled and ``__cleanup__(exc)`` runs.  The endpoint that calls it goes on to its end::

            context().actor_instance.abort("lost the data loader")
        """
        if not self.actor_id:
            raise RuntimeError("abort() stops an actor; call it from an endpoint, not outside one")
        Runtime.current().abort_actor(self.actor_id, reason)

    @property
    def proc(self) -> ProcMesh:
        """The one-rank slice of ``proc_mesh`` this actor runs on."""
        pm = self.proc_mesh
        return pm.slice(**self.rank) if len(self.rank) else pm


@dataclass
class Context:
    actor_instance: ActorInstance
    message_rank: Point


def _extent(dims) -> Extent:
    return Extent(tuple(dims))


def current_rank() -> Point:
    """The calling rank's point in its proc mesh (rank 0 of an empty extent on the controller).

    Example::

        %%mesh
        from monarch_kernel import current_rank
        print(current_rank().rank)           # [rank 0] 0, [rank 1] 1, ...
    """
    ctx = current_actor.get()
    if ctx is not None:
        return Point.from_rank(ctx.rank, _extent(ctx.mesh.dims))
    mesh, rank = process_mesh
    if mesh is None:
        return Point((), Extent(()))
    return Point.from_rank(rank, _extent(mesh.dims))


def current_size() -> dict:
    """``{dim: size}`` of the calling rank's proc mesh.

    Example::

        %%mesh
        from monarch_kernel import current_size
        current_size()                       # {'gpus': 4} on every rank
    """
    ctx = current_actor.get()
    mesh = ctx.mesh if ctx is not None else process_mesh[0]
    return dict(mesh.dims) if mesh is not None else {}


def context() -> Context:
    """The actor and message being served (outside an endpoint: the process itself).

    Example::

        class Trainer(Actor):
            @endpoint
            def where(self) -> str:
                return str(context().actor_instance.proc_mesh)
    """
    ctx = current_actor.get()
    if ctx is None:
        p = current_rank()
        mesh = process_mesh[0]
        return Context(ActorInstance(p, "", mesh.id if mesh else "", None, mesh if _is_rank(mesh) else None), p)
    extent = _extent(ctx.mesh.dims)
    rank = Point.from_rank(ctx.rank, extent)
    if ctx.message_dims is not None and ctx.message_rank is not None:  # set together
        msg = Point.from_rank(ctx.message_rank, _extent(ctx.message_dims))
    else:
        msg = rank
    return Context(ActorInstance(rank, ctx.actor, ctx.mesh.id, ctx.instance, ctx.mesh), msg)


def current_actor_name() -> str:
    """This actor's name, distinct on every rank: ``"<proc mesh>[<rank>].<actor id>"``
    (``"client"`` on the controller outside an actor, as Monarch's root client).

    Example::

        class Trainer(Actor):
            @endpoint
            def name(self) -> str:
                return current_actor_name()     # e.g. 'procs[1].trainers'
    """
    ctx = current_actor.get()
    if ctx is not None:
        return f"{ctx.mesh.name}[{ctx.rank}].{ctx.actor}"
    mesh, rank = process_mesh
    return f"{mesh.name}[{rank}]" if _is_rank(mesh) else "client"


def _is_rank(mesh: MeshRef | None) -> bool:
    """Whether ``mesh`` (this process's) is one it was launched into, not its own self mesh."""
    rt = Runtime.existing()
    return mesh is not None and (rt is None or mesh is not rt.self_mesh)
