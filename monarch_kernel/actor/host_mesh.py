"""``HostMesh``: where procs are started.  ``this_host()`` is the local machine (ranks are
forked from a pre-started template, one per Python interpreter); ``this_proc()`` is the
calling process itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..runtime import Completion, NoRoom, ProcessDied, RestartPolicy, Runtime, config, counted
from . import tensor_shim
from .controllers import publish_registry
from .fault_hook import route_unhandled
from .future import Future
from .proc_mesh import ProcMesh
from .shape import Extent, Shape
from .spawn_checks import check_env, check_mesh_name, check_per_host, check_room, refusal, size_of

_names: dict[str, int] = {}


class MeshReplacedWarning(UserWarning):
    """``spawn_procs(name=N)`` stopped the running mesh ``N`` of this process to start the new
    one in its place (a cell run again)."""

# What every rank unpickles: the template imports these before it forks, so ranks start warm.
RANK_MODULES = tuple(f"monarch_kernel.{m}" for m in (
    "actor.actor", "actor.actor_mesh", "actor.endpoint", "actor.errors", "actor.future", "actor.port",
    "actor.fault_hook", "actor.value_mesh", "actor.host_mesh", "actor.proc_mesh", "actor.shape"))


class HostMesh:
    """Hosts procs are started on: this machine (``this_host()``), or the hosts of a job
    (``monarch_kernel.job``), each running an agent that forks ranks there.

    Example::

        procs = this_host().spawn_procs(per_host={"gpus": 4})
    """

    def __init__(self, hosts: int = 1, python_executable: str | None = None, agents: list | None = None,
                 job=None):
        """``job``: the job whose hosts these are (its ``kill()`` and ``release()`` end or let
        go of them: ``shutdown()``, ``stop()``)."""
        self._hosts = len(agents) if agents else hosts
        self._python = python_executable  # None: the controller's own interpreter
        self._agents = list(agents) if agents else None  # the runtime's links to the hosts' agents
        self._job = job

    @property
    def host_names(self) -> list[str]:
        """The hosts, as the job names them (this machine's name for ``this_host()``)."""
        if self._agents is None:
            import socket

            return [socket.gethostname()]
        return [a.host for a in self._agents]

    @property
    def extent(self) -> Extent:
        return Extent({"hosts": self._hosts})

    @property
    def is_fake_in_process(self) -> bool:
        """Always False: every rank here is a process of its own (Monarch's name)."""
        return False

    def stop(self) -> Future:
        """End every proc on these hosts and let go of them (Monarch's name): workers that a
        scheduler started (``attach_to_workers``) wait for the next controller."""
        self._job_of("stop").release()
        return _done()

    def shutdown(self) -> Future:
        """End every proc on these hosts and what runs them (Monarch's name): the job's
        agents, and workers that a scheduler started (``attach_to_workers``) exit."""
        self._job_of("shutdown").kill()
        return _done()

    def _job_of(self, what: str):
        if self._job is None:
            raise RuntimeError(f"{what}() is for a job's hosts (attach_to_workers, job.state()); this machine's "
                               "procs end with procs.stop()")
        return self._job

    def with_python_executable(self, python_executable: str) -> HostMesh:
        """This host mesh, with procs started by ``python_executable`` (another venv, a
        wrapper script): ``this_host().with_python_executable("/env/bin/python")``.  It must
        be able to import monarch_kernel; ranks still get the controller's ``sys.path``."""
        if not isinstance(python_executable, str) or not python_executable:
            raise TypeError(f"with_python_executable takes a path to an interpreter, not {python_executable!r}")
        if self._agents is not None:
            raise ValueError("the interpreter of a job's hosts is the job's: SSHJob(python_exe=...), "
                             "SlurmJob(python_exe=...)")
        return HostMesh(self._hosts, python_executable)

    def spawn_procs(self, per_host: dict | None = None, bootstrap: Callable[[], Any] | None = None,
                    name: str | None = None, *, env: dict | None = None, timeout: float | None = None,
                    check_limits: bool | None = None, restart: str = "never", max_restarts: int = 3,
                    restart_window: float = 600.0) -> ProcMesh:
        """Start ``per_host`` ranks (``{"gpus": 4}``); returns once all have connected.
        ``bootstrap``: a picklable function (sync or async) each rank runs before anything
        else, e.g. to set ``CUDA_VISIBLE_DEVICES``; if it raises, the spawn raises
        ``ActorError`` with its traceback.  Before anything starts, the arguments are checked
        and so is the hosts' room for the ranks (memory, process and open-files limits);
        ``check_limits=False`` skips the room check (default: MONARCH_KERNEL_CHECK_LIMITS).
        ``restart="on-failure"``: a rank that dies is replaced with its actors, at most
        ``max_restarts`` times within ``restart_window`` seconds (``ProcMesh.set_restart_policy``)."""
        policy = RestartPolicy(restart, max_restarts, float(restart_window))  # a bad one refused before a start
        dims = check_per_host(per_host, on_job=self._agents is not None)
        env = check_env(env)
        if name is not None:
            check_mesh_name(name)
        check = config.check_limits() if check_limits is None else bool(check_limits)
        rt = Runtime.current()
        n = size_of(dims)
        check_room(dict(dims), n, self._hosts, local=self._agents is None, check=check,
                   per_template=rt.per_template)
        # A name is one running mesh's.  The same name again is a cell run again: the old
        # mesh (this process's) ends and the new one takes its place.
        running = {om.ref.name: om for om in rt.owned_meshes() if not om.stopping and om.alive}
        if name is None:
            name = _fresh_name(running)
        elif name in running:
            _replace(rt, running[name])
        pickled = _pickle_bootstrap(bootstrap)  # a bootstrap that cannot travel is refused before a start
        rt.warm(RANK_MODULES)
        if self._agents is None:
            rt.start_templates(n, self._python)  # their interpreters start while the rest is set up
        route_unhandled(rt)
        from ..history import begin_run, hosts_env, record_history  # loaded by the first spawn: import stays quick

        record_history(rt)
        run = begin_run(name)  # this spawn is a run of its own: its history goes to a folder of its own
        publish_registry(rt)
        if self._agents is not None:
            dims = (("hosts", len(self._agents)),) + dims
            env = {**hosts_env(run), **env}  # the hosts' agents write their history where this process does
        try:
            om = rt.spawn_mesh(name, dims, env, bootstrap=pickled, python=self._python, hosts=self._agents,
                                 check=check)
        except NoRoom as e:  # a host of the job has no room: nothing was started
            raise refusal(dict(dims[1:]), n, e.shortfall, e.host) from None
        pm = ProcMesh(om.ref, Shape.full(dict(dims)), om)
        if policy.on_failure:
            pm.set_restart_policy(policy.restart, max_restarts=policy.max_restarts,
                                  restart_window=policy.restart_window)
        if rt.io.is_current():
            return pm
        # By default the spawn timeout, and at least 0.1 s a rank (a large mesh on a small machine).
        timeout = max(config.spawn_timeout(), 0.1 * om.ref.size) if timeout is None else timeout
        if not om.ready.wait(timeout):
            pm.stop()
            raise TimeoutError(
                f"timed out after {timeout:g} s waiting for {counted(om.ref.size, 'rank')} of mesh '{name}' "
                f"to connect ({len(om.up)} connected); raise MONARCH_KERNEL_SPAWN_TIMEOUT if the machine is busy"
            )
        err = om.ready.error()
        if err is not None:
            pm.stop()
            if isinstance(err, ProcessDied):
                raise ProcessDied(err.death) from None
            raise err
        for hook in rt.hooks.spawned.all():  # the kernel's: breakpoint() on its ranks reaches the notebook
            hook(pm)
        return pm

    def __repr__(self) -> str:
        python = f" python={self._python!r}" if self._python else ""
        return f"HostMesh<{self.extent!r}{python}>"


def _fresh_name(running) -> str:
    """``procs``, then ``procs1``, ``procs2``...: the first not taken by a running mesh."""
    while True:
        _names["procs"] = _names.get("procs", 0) + 1
        name = f"procs{_names['procs'] - 1}" if _names["procs"] > 1 else "procs"
        if name not in running:
            return name


def _replace(rt: Runtime, om) -> None:
    """End this process's running mesh ``om`` for a new one of its name, and say so."""
    n = om.ref.size
    Future(rt.stop_mesh(om), lambda _: None).get(timeout=config.spawn_timeout())
    tensor_shim.forget(om.ref.id)  # its tensor client, if tensors were used
    warnings.warn(f"spawn_procs(name={om.ref.name!r}): stopped the running mesh '{om.ref.name}' "
                  f"({counted(n, 'rank')}) to start this one in its place; leave name= out to keep both",
                  MeshReplacedWarning, stacklevel=3)


def _done() -> Future:
    done = Completion()
    done.set_result(None)
    return Future(done)


def _pickle_bootstrap(fn) -> bytes | None:
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"bootstrap= takes a function the ranks run, not {type(fn).__name__}")
    import cloudpickle

    try:
        return cloudpickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"the bootstrap function {getattr(fn, '__qualname__', fn)!r} cannot be sent to the "
                        f"ranks: {e}") from e


def this_host() -> HostMesh:
    """The machine this process runs on.

    Example::

        procs = this_host().spawn_procs(per_host={"gpus": 4})
    """
    return HostMesh(1)


def this_proc() -> ProcMesh:
    """A one-rank mesh that is the calling process itself.

    Example::

        counter = this_proc().spawn("counter", Counter, 0)   # an actor in this process
        counter.incr.call_one().get()
    """
    rt = Runtime.current()
    route_unhandled(rt)
    return ProcMesh(rt.self_mesh, Shape.full({}), None)
