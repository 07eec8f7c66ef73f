"""What the Mesh panel's buttons do in the kernel: interrupt, restart, stacks, debug, the
table toggle, use, stop, spawn (the New mesh dialog), and the sparklines' samples.  The feed
(``feed.py``) routes each request here by its action and sends the reply.  Runs in the kernel.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ...debug.controller import proxy
from ...runtime import Runtime, counted, rank_label
from .messages import Metrics, Request

if TYPE_CHECKING:
    from ..session import MeshSession
    from .view import PanelView, RankLog


class PanelButtons:
    """One method a button (named as the request's action); each returns the sentence the
    panel shows, or raises with what to do instead."""

    def __init__(self, session: MeshSession, view: PanelView, log: RankLog, *, tell_notebook: Callable[..., None],
                 sync_attached: Callable[[], None]):
        """``tell_notebook``: a line for the running (or next) cell; ``sync_attached``: marks
        the detached meshes this kernel holds after a spawn or a stop."""
        self.session = session
        self.shell = session.shell
        self.view, self.log = view, log
        self.tell_notebook, self.sync_attached = tell_notebook, sync_attached

    def _procs(self, req: Request):
        return self.session.get(req.mesh or None)

    def interrupt(self, req: Request) -> str:
        procs, consoles = self._procs(req)
        ranks = [req.rank] if req.rank is not None else None
        procs.interrupt(consoles, ranks, wait=2.0)
        where = "" if procs.name == self.session.current else f" of {procs.name}"
        self.tell_notebook(f"{rank_label(ranks or range(len(procs)))}{where} interrupted from the Mesh panel",
                           later=False)  # an idle rank's interrupt changes nothing a cell would see
        return f"interrupted {rank_label(ranks, brackets=False) if ranks else 'every rank'} of {procs.name}"

    def restart(self, req: Request) -> str:
        procs, _consoles = self._procs(req)
        ranks = req.ranks if req.ranks is not None else ([req.rank] if req.rank is not None else None)
        done = self.session.restart(procs.name, ranks)  # ProcMesh.restart: the one restart path
        if not done.ranks:
            return f"no dead ranks in {procs.name}"
        killed = f" ({rank_label(done.killed, brackets=False)} not responding: killed first)" if done.killed else ""
        return f"restarted {rank_label(done.ranks, brackets=False)} of {procs.name} with fresh namespaces{killed}"

    def stacks(self, req: Request) -> tuple[str, str]:
        """The grouped stacks of the mesh (or of one rank), while a cell may be running: the
        panel's comm has its own thread, and py-spy reads the ranks from outside."""
        procs, _consoles = self._procs(req)
        ranks = [req.rank] if req.rank is not None else req.ranks
        report = procs.stacks(ranks).name_frames(self.session.cells.frame)
        odd = report.odd_ranks()
        return (f"stacks of {procs.name}: {counted(len(report.groups), 'group')}"
                + (f", {rank_label(odd, brackets=False)} differ{'s' if len(odd) == 1 else ''} from the rest"
                   if odd else ""), repr(report))

    def metrics(self, req: Request, points: int) -> Metrics:
        """Each rank's sampled CPU, memory and GPU, its last ``points`` samples (sparklines)."""
        try:
            procs, _consoles = self._procs(req)
        except UsageError:
            return Metrics(req.mesh, {})
        self.session.metrics.sample(procs)
        series = {str(r): {"cpu": [p.cpu for p in pts], "rss_mib": [p.rss_mib for p in pts],
                           "gpu": [p.gpu for p in pts], "gpu_mib": [p.gpu_mib for p in pts]}
                  for r in procs.shape.ranks for pts in [self.session.metrics.series(procs.name, r)[-points:]]}
        return Metrics(procs.name, series)

    def debug(self, req: Request) -> str:
        procs, _consoles = self._procs(req)
        if req.rank is None:
            raise UsageError("debug needs a rank")
        self.session.current = procs.name
        proxy.command(self.session, self.shell, [str(req.rank)])
        return (f"JupyterLab's debugger now debugs rank {req.rank} of {procs.name}: switch the debugger on "
                f"(the bug icon) and set breakpoints in %%mesh cells")

    def table(self, req: Request) -> str:
        """The full table of a mesh over ``status.SUMMARY_OVER`` ranks (``full``), kept in
        every state sent until the panel asks for the summary again (or its last panel closes)."""
        procs, _c = self._procs(req)
        if req.full:
            self.view.expanded.add(procs.name)
            return f"every rank of {procs.name} is listed ({counted(len(procs), 'row')})"
        self.view.expanded.discard(procs.name)
        return f"{procs.name} is summarised: ranks that are not idle are listed"

    def use(self, req: Request) -> str:
        procs, _c = self._procs(req)
        self.session.current = procs.name
        self.tell_notebook(f"%mesh: {procs.name} made current from the Mesh panel: %%mesh cells run on its "
                           f"{len(procs)} rank{'s' if len(procs) != 1 else ''}")
        return f"{procs.name} is the current mesh"

    def stop(self, req: Request) -> str:
        procs, _c = self._procs(req)
        self.shell.run_line_magic("mesh", f"stop {procs.name}")
        self.log.forget(procs.name)
        self.view.expanded.discard(procs.name)
        self.sync_attached()
        now = self.session.current
        self.tell_notebook(f"%mesh: mesh {procs.name} stopped from the Mesh panel"
                           + (f"; {now} is the current mesh" if now else "; no mesh is left"))
        return f"stopped {procs.name}"

    def spawn(self, req: Request) -> str:
        """Spawn the New mesh dialog's mesh under a name no other has (a taken one is refused,
        never replaced).  It becomes current only if ``use`` or no other mesh is (the notebook's
        next ``%%mesh`` cell must not move to it unasked), and the notebook is told."""
        s = self.session
        if req.name in s.meshes:
            raise UsageError(f"a mesh named {req.name!r} exists: stop it first, or pick another name")
        taken = set(s.meshes) | {om.ref.name for om in Runtime.current().owned_meshes() if not om.stopping}
        req = dataclasses.replace(req, name=req.name or fresh_name(taken))
        line = spawn_line(req)
        before = s.current
        procs = self.shell.run_line_magic("mesh", line)
        if procs is None:
            raise RuntimeError(f"%mesh {line} returned no mesh")
        bound = self.shell.user_ns.get(procs.name)
        named = procs.name.isidentifier() and (bound is None or type(bound).__name__ == "ProcMesh")
        if named:
            self.shell.user_ns[procs.name] = procs  # the dialog's mesh is a name in the notebook too
        self.sync_attached()
        if not req.use and before is not None and before != procs.name and before in s.meshes:
            s.current = before
            how = f"{before} stays current (%mesh use {procs.name}, or Use in the panel, makes it current)"
        else:
            how = "it is the current mesh: %%mesh cells run on it"
        n = counted(len(procs), "rank")
        self.tell_notebook(f"%mesh: the Mesh panel spawned mesh {procs.name}: {n} (%mesh {line})"
                           + (f"; the variable {procs.name} holds it" if named else "") + f"; {how}")
        return f"{procs.name}: {n} (%mesh {line}); {how}"


def fresh_name(taken) -> str:
    """``procs``, else ``procs1``, ``procs2``...: the first name ``taken`` does not hold."""
    n = 0
    while (name := f"procs{n or ''}") in taken:
        n += 1
    return name


def spawn_line(req: Request) -> str:
    """The ``%mesh spawn`` line the New mesh dialog stands for."""
    if req.n < 1:
        raise UsageError("the rank count is at least 1")
    words = ["spawn", "-n", str(req.n)]
    if req.name:
        words += ["--detach" if req.detach else "--name", req.name]
    elif req.detach:
        raise UsageError("a detached mesh needs a name (it is how you attach it again)")
    if req.launcher == "ssh":
        if not req.hosts:
            raise UsageError("an ssh job needs its hosts (h1,h2)")
        words += ["--job", "ssh", "--hosts", req.hosts]
        if req.ssh_args:
            words += ["--ssh-args", req.ssh_args]
    elif req.launcher == "slurm":
        words += ["--job", "slurm", "--nodes", str(req.nodes or 1)]
        for flag, value in (("--partition", req.partition), ("--time", req.time), ("--account", req.account)):
            if value:
                words += [flag, value]
    elif req.launcher and req.launcher != "local":
        words += ["--job", req.launcher]
    return " ".join(shlex.quote(w) for w in words)


__all__ = ["PanelButtons", "fresh_name", "spawn_line"]
