"""``ProcMesh``: a set of rank processes with named dims; actors are spawned onto it.

Example::

    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        counters = procs.spawn("counters", Counter, 0)
"""

from __future__ import annotations

import logging
import os

from ..observe.stack_report import StackReport
from ..observe.stacks import take as take_stacks
from ..runtime import (
    ActorError,
    Kind,
    MeshFailure,
    MeshStopped,
    ProcessDied,
    Runtime,
    SendFailed,
    actor_path,
    counted,
    current_actor,
    new_actor_id,
)
from . import self_healing, tensor_shim
from .actor_mesh import ActorMesh, endpoint_names, propagators, retry_counts
from .adverbs import part_value
from .endpoint import refuse_mixed_endpoints
from .future import Future
from .healing import Healing
from .rank_repair import RankRepair, Restarted
from .shape import Shape, Shaped
from .spawn_message import spawn_body, spawn_options


class ProcMesh(Healing, Shaped):
    """Processes (ranks) started by ``HostMesh.spawn_procs``, one per point of its extent; actors
    are spawned on it, and it can be sliced, reshaped, restarted and stopped.

    Example::

        with this_host().spawn_procs(per_host={"gpus": 4}) as procs:
            trainers = procs.spawn("trainers", Trainer, lr=0.1)
            half = procs.slice(gpus=slice(0, 2))
            print(procs.to_table())
    """

    def __init__(self, ref, shape: Shape, owned=None):
        self._given_ref = ref
        self._shape = shape
        self._owned = owned  # OwnedMesh when this process spawned it
        self._stopped = False
        self._stop_future: Future | None = None
        self._repair = RankRepair(ref, owned)  # kill and restart

    @property
    def _ref(self):
        """The mesh's reference as of now: in the process that spawned it, the launcher's
        (a rank restarted on another host has its new address and host there)."""
        om = self._owned
        return self._given_ref if om is None else om.ref

    @property
    def name(self) -> str:
        return self._ref.name

    @property
    def ref(self):
        """The picklable reference to this mesh (what ``ProcMesh.from_ref`` takes back)."""
        return self._ref

    def stopped_here(self) -> bool:
        """Stopped through this handle or another slice of the same mesh (``stopped`` also
        counts a mesh whose every rank ended by a stop)."""
        return self._stopped or (self._owned is not None and self._owned.stopping)

    @property
    def stopped(self) -> bool:
        """Stopped through this handle, another slice of the same mesh, or (seen from
        elsewhere) every rank ended by a stop."""
        if self.stopped_here():
            return True
        rt = Runtime.current()
        if not rt.any_dead():
            return False
        deaths = [rt.death(self._ref.id, r) for r in self._shape.ranks]
        return bool(deaths) and all(d is not None and d.stopped for d in deaths)

    @property
    def owned(self) -> bool:
        """Whether this process spawned the mesh (and so may stop and restart its ranks)."""
        return self._owned is not None

    @classmethod
    def from_ref(cls, ref) -> ProcMesh:
        """A handle on a mesh another process spawned (a detached mesh's host, say): it can
        be called, not stopped or restarted from here."""
        return cls(ref, Shape.full(ref.dims))

    def dead_ranks(self) -> list[int]:
        rt = Runtime.current()
        return [r for r in self._shape.ranks if rt.death(self._ref.id, r) is not None]

    def rank_states(self) -> list[dict]:
        """One row per rank: ``rank``, ``host``, ``pid`` (None if unknown here), ``state``
        ("idle", "busy", "not responding" or "dead"), ``death`` (how it died, or None),
        ``silent_s`` (seconds since its last heartbeat) and ``remote`` (on another host: its
        pid is that host's)."""
        rt = Runtime.current()
        busy = rt.busy_ranks(self._ref.id)
        om = self._owned
        rows = []
        for r in self._shape.ranks:
            death = rt.death(self._ref.id, r)
            info = om.rank_info(r) if om is not None else {"pid": None, "responding": True, "silent_s": 0.0,
                                                            "remote": False}
            if death is not None:
                state = "dead"
            elif not info["responding"]:
                state = "not responding"
            else:
                state = "busy" if r in busy else "idle"
            rows.append({"rank": r, "host": self._ref.hosts[r] if self._ref.hosts else "", "pid": info["pid"],
                         "state": state, "death": death.how() if death is not None else None,
                         "silent_s": info["silent_s"], "remote": info["remote"]})
        return rows

    def restart(self, ranks: list[int] | None = None, actors=(), timeout: float = 60, *,
                kill_unresponsive: bool = True) -> Restarted:
        """Replace ranks with fresh processes (same numbers), then spawn ``actors``
        (``(ActorMesh, cls, args, kwargs)``) on them again, with fresh state.  ``ranks``:
        which (default: every dead rank and, with ``kill_unresponsive``, every rank that
        stopped answering heartbeats); one not responding is SIGKILLed first.  A live rank
        that responds is refused (``ValueError``).  The one restart path: ``%mesh restart``
        and the panel's button call it too.  Returns which ranks it restarted and killed::

            procs.restart()             # Restarted(ranks=[1], killed=[1]): rank 1 had frozen
        """
        return self._repair.restart(self.rank_states, ranks, actors, timeout, kill_unresponsive=kill_unresponsive)

    def kill(self, ranks: list[int], timeout: float = 10) -> None:
        """SIGKILL ``ranks`` (ones that stopped responding); what waits on them fails with
        ``ProcessDied``.  Returns once their deaths are handled."""
        self._repair.kill(ranks, timeout)

    def stacks(self, ranks=None, *, native: bool = False, all_threads: bool = False, runtime_frames: bool = False,
               method: str = "auto", timeout: float | None = None) -> StackReport:
        """Every thread's stack of ``ranks`` (this mesh's indices; all by default), ranks with
        the same stacks grouped, the odd ones out first.  ``method``: ``"auto"`` asks each
        rank for its own dump, and reads those that do not answer (stopped, or in C code
        holding the GIL) from outside with py-spy; ``"py-spy"`` reads every rank from
        outside; ``"in-process"`` only asks.  ``native``: C frames too (py-spy);
        ``all_threads``: also threads running no user code; ``runtime_frames``: keep
        monarch_kernel's own frames."""
        mine = list(self._shape.ranks)
        if ranks is None:
            chosen = mine
        else:
            bad = [r for r in ranks if not 0 <= r < len(mine)]
            if bad:
                raise IndexError(f"ranks {bad} are not in this mesh of {counted(len(mine), 'rank')} "
                                 f"(0-{len(mine) - 1})")
            chosen = [mine[r] for r in ranks]
        return take_stacks(self._ref, chosen, native=native, all_threads=all_threads,
                           runtime_frames=runtime_frames, method=method, timeout=timeout)

    def to_table(self):
        """Which rank sits at each point: a text table (a ``str``) that a notebook shows as
        HTML; ``print(procs.to_table())``."""
        from .mesh_table import mesh_table

        return mesh_table(self._shape, list(self._ref.hosts) if self._ref.hosts else None)

    def _with_shape(self, shape: Shape) -> ProcMesh:
        pm = ProcMesh(self._ref, shape, self._owned)
        pm._stopped = self._stopped
        return pm

    def spawn(self, name: str, cls: type, *args, **kwargs) -> ActorMesh:
        """Start ``cls(*args, **kwargs)`` on every rank and return its mesh at once, as
        Monarch does: ``__init__`` runs on the ranks in the background and calls sent
        meanwhile queue behind it.  An ``__init__`` that raises is a supervision event for the
        spawning actor (``__supervise__``, else ``unhandled_fault_hook``), and later calls to
        that actor fail with its traceback.  ``mesh.initialized()`` waits for every rank."""
        if self.stopped:
            raise MeshStopped(f"mesh '{self.name}' was stopped; spawn a new mesh to host {name!r}")
        if not isinstance(cls, type):
            raise TypeError(f"spawn takes an Actor class, not {type(cls).__name__}")
        refuse_mixed_endpoints(cls)
        actor_id = new_actor_id(name)
        body = spawn_body(cls, args, kwargs)
        rt = Runtime.current()
        owner = current_actor.get()  # failures of this actor mesh go to whoever spawns it
        pending = rt.call(self._ref, actor_id, "__init__", list(self._shape.ranks), body, kind=Kind.SPAWN,
                          options=spawn_options(cls), callbacks=True)
        ranks, mesh_name, dims = list(self._shape.ranks), self.name, self._ref.dims

        def check(parts):
            for r in ranks:
                part_value(parts[r], name, "__init__")

        def constructed(done) -> None:  # on the IO thread, once every rank answered
            for r in ranks:  # one event per rank whose __init__ raised, as in Monarch
                try:
                    part_value(done.result()[r], name, "__init__")
                except (ProcessDied, MeshStopped, SendFailed):
                    continue  # a death or a stop has its own report (or is no failure)
                except ActorError as e:
                    path = actor_path(owner, f"{cls.__module__}.{cls.__qualname__}", actor_id, r, dims)
                    rt.report_failure_to(owner, MeshFailure(mesh_name, r, str(e), remote=e.failure, actor=path))

        pending.completion.add_done_callback(constructed)
        if self._owned is not None:  # a death of these ranks is reported as this actor's failure
            rt.note_hosted(self._ref.id, owner, f"{cls.__module__}.{cls.__qualname__}", actor_id, ranks)
        if owner is not None:  # it stops when the actor that spawns it does
            rt.note_spawned(owner.actor, self._ref, actor_id, ranks)
        mesh: ActorMesh = ActorMesh(self._ref, actor_id, name, cls.__qualname__, endpoint_names(cls), self._shape,
                                    self, initialized=Future(pending.completion, check), owner=(owner,))
        mesh._propagators, mesh._class_module, mesh._retries = propagators(cls), cls.__module__, retry_counts(cls)
        if self._owned is not None:  # a replaced rank gets it again, built from the same arguments
            self_healing.healer_of(self).note_spawned(mesh, cls, args, kwargs)
        return mesh

    def stop(self) -> Future:
        """End every rank; the Future resolves once they have exited.  Ranks are ended even
        if nobody waits."""
        if self._stop_future is None:
            self._stopped = True
            if self._owned is None:
                raise RuntimeError(f"mesh '{self.name}' was spawned by another process; only its owner can stop it")
            rt = Runtime.current()
            self_healing.forget(self._ref.id)
            self._stop_future = Future(rt.stop_mesh(self._owned), lambda _: None)
            tensor_shim.forget(self._ref.id)  # its tensor client, if tensors were used
        return self._stop_future

    def interrupt(self, actors=None, ranks=None, wait: float = 0.0) -> bool:
        """Raise ``KeyboardInterrupt`` in the sync endpoints running on these ranks now (the
        stop button's effect): of one ``ActorMesh``, or of every actor; ``ranks``: only
        those; ``wait``: seconds to wait until each rank has delivered it (True if all did).
        An actor on the rank's main thread (``Actor.runs_on_main_thread``) is interrupted
        even inside a blocking call; others at their next bytecode."""
        actor_id = "" if actors is None else actors.actor_id
        ranks = list(self._shape.ranks) if ranks is None else list(ranks)
        return Runtime.current().interrupt_ranks(self._ref, ranks, actor_id, wait=wait)

    async def logging_option(self, stream_to_client: bool = True, aggregate_window_sec: float | None = 3,
                             level: int = logging.INFO) -> None:
        """Forward the ranks' log records at ``level`` and up to the controller (none when
        not ``stream_to_client``); a coroutine, as Monarch's:
        ``asyncio.run(procs.logging_option(level=logging.WARNING))``.  Ranks' stdout and
        stderr always stream; ``aggregate_window_sec`` is accepted and ignored."""
        from .logging_option import set_logging

        await set_logging(self, stream_to_client, aggregate_window_sec, level)

    def sync_workspace(self, path=None, *, auto_reload: bool = True, exclude=(), max_file_size: int = 8 << 20,
                       timeout: float = 60.0):
        """Send the changed files of folder ``path`` (default: the current directory) to
        each host of this mesh, into a per-job copy first on every rank's ``sys.path``, and
        re-import the modules whose files changed (``auto_reload``, Monarch's name).  Blocks;
        returns a ``WorkspaceSync`` (one ``HostSync`` per host: files sent, bytes, deleted,
        unchanged, modules reloaded)::

            procs.sync_workspace("~/project/src")      # then: import mymod, on any rank
        """
        from .code_sync.workspace import sync_workspace

        return sync_workspace(self, None if path is None else os.path.expanduser(os.fspath(path)),
                              auto_reload=auto_reload, exclude=exclude, max_file_size=max_file_size, timeout=timeout)

    def activate(self):
        """A context in which torch calls run on every rank of this mesh, as Monarch's: the
        tensors made inside are distributed (``monarch_kernel.Tensor``), their shapes known at
        once, their values on the ranks (``inspect(t)`` fetches one shard)::

            with procs.activate():
                t = torch.rand(3, 4)
                u = t @ t.T
            inspect(u, gpus=1)
        """
        return tensor_shim.tensors().tensor_mesh(self).activate()

    def rank_tensor(self, dim: str):
        """A distributed 0-dim int64 tensor: each rank's index along ``dim``."""
        return tensor_shim.tensors().rank_tensor(self, dim)

    def rank_tensors(self) -> dict:
        """``{dim: rank_tensor(dim)}`` for every dim."""
        return tensor_shim.tensors().rank_tensors(self)

    def __getattr__(self, name: str):
        if name in _SPMD_FUNCTIONS:  # torch.distributed is spmd's, a layer above: its free functions
            raise AttributeError(f"ProcMesh has no {name}(); torch.distributed set-up lives in monarch_kernel.spmd, "
                                 f"as in Monarch: from monarch_kernel.spmd import {name}; {name}(procs, ...)")
        raise AttributeError(f"'ProcMesh' object has no attribute {name!r}")

    def __enter__(self) -> ProcMesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop().get(timeout=30)

    async def __aenter__(self) -> ProcMesh:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def __reduce__(self):
        return (ProcMesh, (self._ref, self._shape))

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"ProcMesh<'{self.name}' {self.extent!r} {state}>"


def whole_mesh(procs: ProcMesh) -> ProcMesh:
    """The whole proc mesh ``procs`` is a slice of, with the same rights (spawn, stop) as
    ``procs``: what spawns an actor on every rank of it (the tensor engine)."""
    return ProcMesh(procs.ref, Shape.full(procs.ref.dims), procs._owned)


_SPMD_FUNCTIONS = ("setup_torch_distributed", "device_mesh", "setup_torch_elastic_env", "collectives",
                   "profile")
