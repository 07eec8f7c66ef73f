"""``HostMesh``: where procs are started.  ``this_host()`` is the local machine (ranks are
forked from a pre-started template); ``this_proc()`` is the calling process itself.
"""

from __future__ import annotations

from ..actor.supervision import route_unhandled
from ..runtime import config
from ..runtime.failure import ProcessDied
from ..runtime.process import Runtime
from .proc_mesh import ProcMesh
from .shape import Extent, Shape

_names: dict[str, int] = {}
# What every rank unpickles: the template imports these before it forks, so ranks start warm.
RANK_MODULES = tuple(f"monarch_kernel.{m}" for m in (
    "actor.actor", "actor.actor_mesh", "actor.endpoint", "actor.errors", "actor.future", "actor.port",
    "actor.supervision", "actor.value_mesh", "mesh.host_mesh", "mesh.proc_mesh", "mesh.shape"))


class HostMesh:
    def __init__(self, hosts: int = 1):
        self._hosts = hosts

    @property
    def extent(self) -> Extent:
        return Extent({"hosts": self._hosts})

    def spawn_procs(self, per_host: dict | None = None, *, name: str | None = None,
                    env: dict | None = None, timeout: float | None = None) -> ProcMesh:
        """Start ``per_host`` ranks (``{"gpus": 4}``); returns once all have connected."""
        per_host = {"procs": 1} if per_host is None else dict(per_host)
        for k, v in per_host.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"per_host={{{k!r}: {v!r}}}: sizes must be positive ints, e.g. per_host={{'gpus': 4}}")
        if name is None:
            _names["procs"] = _names.get("procs", 0) + 1
            name = f"procs{_names['procs'] - 1}" if _names["procs"] > 1 else "procs"
        rt = Runtime.current()
        route_unhandled(rt)
        rt.warm(RANK_MODULES)
        om = rt.launcher.spawn(name, tuple(per_host.items()), env)
        pm = ProcMesh(om.ref, Shape.full(per_host), om)
        if rt.io.is_current():
            return pm
        timeout = config.spawn_timeout() if timeout is None else timeout
        if not om.ready.wait(timeout):
            pm.stop()
            raise TimeoutError(
                f"timed out after {timeout:g} s waiting for {om.ref.size} ranks of mesh '{name}' "
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
        return f"HostMesh<{self.extent!r}>"


def this_host() -> HostMesh:
    """The machine this process runs on."""
    return HostMesh(1)


def this_proc() -> ProcMesh:
    """A one-rank mesh that is the calling process itself."""
    rt = Runtime.current()
    route_unhandled(rt)
    return ProcMesh(rt.self_mesh, Shape.full({}), None)
