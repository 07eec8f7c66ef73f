"""``ActorMesh``: one actor per rank of a proc mesh, called through its endpoints.

It is a small picklable reference: pass it to another actor and that actor calls it
directly, rank to rank, without the controller.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from ..runtime import STOP_METHOD, CallInfo, MeshRef, MeshStopped, ProcessDied, Runtime, dumps
from .adverbs import Endpoint, part_value
from .endpoint import ENDPOINT_MARK, RREF_METHOD
from .shape import Shape, Shaped


def endpoint_names(cls) -> tuple[str, ...]:
    return tuple(sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), ENDPOINT_MARK, False)
                        and n != RREF_METHOD))


def retry_counts(cls) -> dict[str, int]:
    """``{endpoint: its retries=}`` for the endpoints that declare retries."""
    return {n: getattr(getattr(cls, n), "__monarch_retries__", 0) for n in endpoint_names(cls)
            if getattr(getattr(cls, n), "__monarch_retries__", 0)}


def propagators(cls) -> dict:
    """``{endpoint: its propagate=}`` for the endpoints that declare one (``rref``)."""
    out = {}
    for n in endpoint_names(cls):
        p = getattr(getattr(cls, n), "__monarch_propagate__", None)
        if p is not None:
            out[n] = p
    return out


T = TypeVar("T")


class ActorMesh(Shaped, Generic[T]):
    """Actors of class ``T``, one per rank (``ActorMesh[Trainer]`` in annotations).

    Example::

        trainers = procs.spawn("trainers", Trainer, lr=0.1)   # ActorMesh[Trainer]
        trainers.slice(gpus=0).step.call_one(8).get()
    """

    def __class_getitem__(cls, _item):
        """``ActorMesh[...]`` is the class itself at run time, as in Monarch (the parameter is
        for type checkers), so it can be called, subclassed and compared."""
        return cls

    def __init__(self, proc_ref: MeshRef, actor_id: str, name: str, class_name: str,
                 endpoints: tuple[str, ...], shape: Shape, proc_mesh=None, *, initialized=None, owner=None):
        self._given_ref = proc_ref
        self._actor_id = actor_id
        self._name = name
        self._class_name = class_name
        self._endpoints = endpoints
        self._shape = shape
        self._proc_mesh = proc_mesh  # the owner's ProcMesh, for stop state; None in copies
        self._initialized = initialized  # the spawn's Future, in the process that spawned it
        self._owner = owner  # (ActorContext or None,) of its spawner, in the process that spawned it
        self._call_info: CallInfo | None = None  # the CallInfo of this slice, once an endpoint has made it
        self._propagators: dict | None = None  # endpoint -> propagate=, where the class is known (rref)
        self._class_module = ""  # the class's module, where known: failure reports name it as Monarch's do
        self._retries: dict[str, int] = {}  # endpoint -> its retries= (where the class is known)
        self._actors_stopped = False  # stop() was called on this handle

    @property
    def _proc_ref(self) -> MeshRef:
        """Its proc mesh's reference as of now (where the owner's ``ProcMesh`` is at hand:
        a rank restarted on another host has its new address there)."""
        pm = self._proc_mesh
        return self._given_ref if pm is None else pm.ref

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._endpoints:
            ep = self.__dict__[name] = Endpoint(self, name)  # found as an attribute from now on
            return ep
        raise AttributeError(
            f"{self._class_name} has no endpoint {name!r}; its endpoints are: "
            f"{', '.join(self._endpoints) or '(none)'}. Mark methods with @endpoint."
        )

    def __dir__(self):
        return [*super().__dir__(), *self._endpoints]

    @property
    def name(self) -> str:
        return self._name

    def initialized(self):
        """A Future that resolves once ``__init__`` has returned on every rank (raising what
        it raised); already done for a mesh that was not spawned here."""
        from .future import Future

        return self._initialized if self._initialized is not None else Future.ready(None)

    @property
    def actor_id(self) -> str:
        """This actor's id on every rank (with ``proc_ref``, what ``from_ref`` takes back)."""
        return self._actor_id

    @property
    def proc_ref(self) -> MeshRef:
        return self._proc_ref

    @classmethod
    def from_ref(cls, proc_mesh, actor_id: str, name: str, actor_class: type) -> ActorMesh:
        """A handle on actors of ``actor_class`` that another process spawned on
        ``proc_mesh`` under ``actor_id`` (a detached mesh's consoles, say)."""
        return cls(proc_mesh.ref, actor_id, name, actor_class.__qualname__, endpoint_names(actor_class),
                   Shape.full(proc_mesh.ref.dims), proc_mesh)

    def _with_shape(self, shape: Shape) -> ActorMesh[T]:
        # A view's failures go where its parent's go.
        m: ActorMesh[T] = ActorMesh(self._proc_ref, self._actor_id, self._name, self._class_name, self._endpoints,
                                    shape, self._proc_mesh, initialized=self._initialized, owner=self._owner)
        m._propagators, m._class_module, m._retries = self._propagators, self._class_module, self._retries
        return m

    def stop(self):
        """Stop these actors on every rank of the mesh, but not their processes, as
        Monarch does: each finishes the messages sent before, its concurrent endpoints are
        cancelled, ``__cleanup__(None)`` runs, and later calls to it fail saying it was
        stopped.  A Future (awaitable) that resolves once every rank has stopped it::

            await trainers.stop()      # or trainers.stop().get()
        """
        from .future import Future

        pm = self._proc_mesh
        self._actors_stopped = True  # a restart of the proc mesh's ranks does not spawn it again
        if pm is not None and pm.stopped:
            return Future.ready(None)  # its processes are gone, and the actors with them
        ranks, name = list(self._shape.ranks), self._class_name
        pending = Runtime.current().call(self._proc_ref, self._actor_id, STOP_METHOD, ranks, dumps(((), {})))

        def stopped(parts) -> None:
            for r in ranks:
                try:
                    part_value(parts[r], name, "stop")
                except (ProcessDied, MeshStopped):
                    continue  # no process, no actor to stop
            return None

        return Future(pending.completion, stopped, pending.inbox)

    def actors_stopped(self) -> bool:
        """Whether ``stop()`` was called on this handle (a restarted rank does not get it)."""
        return self._actors_stopped

    def _check_running(self) -> Runtime:
        """Raise ``MeshStopped`` if the mesh was stopped; else this process's runtime."""
        pm = self._proc_mesh
        rt = Runtime.current()
        dead = rt.any_dead()
        if pm is not None and (pm.stopped_here() or (dead and pm.stopped)):
            raise MeshStopped(f"mesh '{self._proc_ref.name}' was stopped; {self._class_name} "
                              f"'{self._name}' cannot be called. Spawn a new mesh.")
        if not dead:
            return rt
        if all((info := rt.death(self._proc_ref.id, r)) is not None and info.stopped for r in self._shape.ranks):
            raise MeshStopped(f"mesh '{self._proc_ref.name}' was stopped; spawn a new mesh.")
        return rt

    def __reduce__(self):
        return (ActorMesh, (self._proc_ref, self._actor_id, self._name, self._class_name,
                            self._endpoints, self._shape), {"_class_module": self._class_module,
                                                            "_retries": self._retries})

    def __repr__(self) -> str:
        return f"ActorMesh<{self._class_name} '{self._name}' {self.extent!r}>"
