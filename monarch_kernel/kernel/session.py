"""``MeshSession``: the meshes one kernel (or IPython shell) drives, which one is current,
and the hooks the kernel has installed in the runtime, so that closing the session takes
every one of them out again.  Runs in the kernel.
"""

from __future__ import annotations

import logging

from IPython.core.error import UsageError

from .. import history
from ..actor.adverbs import sends_total
from ..actor.errors import ActorError
from ..console.console import Console
from ..debug.controller import proxy
from ..debug.controller.pdb_controller import PdbHub
from ..observe.metrics import RankMetrics
from ..runtime import Runtime, config, counted
from . import detached
from .cell_errors import cell_label
from .cell_names import CellNames
from .jobs import KernelJobs
from .last_lines import LastLines
from .live_record import LiveRecord
from .output import CollapsingSink
from .panel.feed import PanelFeed
from .respawn import Respawn
from .restart_notices import RestartNotices
from .watchdog import Watchdog

OUTPUT_DRAIN_S = config.seconds("output_drain")  # a cell's end waits at most this long for its ranks' output

log = logging.getLogger(__name__)

CONSOLE_MODULES = ("monarch_kernel.console.console", "monarch_kernel.console.cells", "monarch_kernel.console.display",
                   "monarch_kernel.console.shell", "monarch_kernel.console.host_once",
                   "monarch_kernel.console.completer",
                   "monarch_kernel.debug.rank.pdb_rank", "monarch_kernel.debug.rank.rank_debugpy")


class MeshSession:
    """The meshes this kernel spawned or attached, and which one is current.  It is the
    ``PdbHost`` its ``PdbHub`` is made with (``meshes``, ``spawning``, ``run_in_cell``, ``cell_label``)."""

    def __init__(self, shell):
        self.shell = shell
        self.meshes: dict[str, tuple] = {}  # name -> (ProcMesh, console ActorMesh)
        self.current: str | None = None
        self.auto = False
        self.live: dict = {}  # mesh name -> its %mesh status widget, refreshing until the mesh stops
        self.hosts: dict = {}  # name -> MeshHost ActorMesh, for detached meshes
        self.raw_cell = ""  # the running cell as typed: %%mesh compiles under its name
        self.cells = CellNames(shell)  # cells named as tracebacks name them (stacks of ranks)
        self.spawning = False  # %mesh spawn is starting a mesh (it sets pdb up through the console)
        self.jobs = KernelJobs()  # ssh and slurm jobs started by %mesh spawn --job
        self.respawn = Respawn(self.stop)  # a spawn of a name taken: reuse the mesh, or stop it first
        rt = Runtime.current()
        # The console actor's modules, imported by the template before it forks: on 1,024
        # ranks, importing them after the fork cost minutes of CPU.
        rt.warm(CONSOLE_MODULES)
        self.sink = CollapsingSink(rt.io.loop)
        self.last_lines = LastLines()  # each rank's last line that says something (status, the panel)
        self.sink.watchers.append(self.last_lines.note)
        self._handles = [rt.hooks.output.install(self.sink)]
        self.metrics = RankMetrics()  # CPU and memory per rank, sampled while %mesh top or a panel watches
        self.watchdog = Watchdog(self)  # %mesh watchdog: stacks of ranks a cell has waited on too long
        self.record = LiveRecord()  # what monarch-kernel ls reads of this kernel, with no connection to it
        self._sends_at_cell = self._synced_at = -1  # sends_total() as the cell began; once its output was in
        self._events = [("pre_run_cell", self.sink.follow_cell), ("pre_run_cell", self._remember_cell),
                        ("pre_run_cell", self.watchdog.cell_starts), ("post_run_cell", self._output_in),
                        ("post_run_cell", self.watchdog.cell_ends),
                        ("post_run_cell", self.note)]
        for event, fn in self._events:
            shell.events.register(event, fn)
        self.pdb = PdbHub(self)
        self.pdb.install()
        self._handles.extend(_keep_cell_filenames(rt))
        self.panel = PanelFeed(self)  # JupyterLab's Mesh panel: silent until a panel opens its comm
        self.panel.install()
        self.restarts = RestartNotices(self)  # each restart by a mesh's policy: a line in the cell, the panel

    def output_synced(self, sent_before: int) -> None:
        """(``%%mesh``) The cell's output is in: every rank it ran on sent its end marker after
        its output.  Unless the cell sent something before (``sent_before``, counted by
        ``sends_total``), its end needs no drain."""
        if sent_before == self._sends_at_cell:
            self._synced_at = sends_total()

    def _output_in(self, _result=None) -> None:
        """A cell ends once what its ranks printed before answering its calls is in it: an
        answer travels apart from the output it follows, and overtakes it.  A ``%%mesh``
        cell that sent nothing else has it already (``output_synced``); the drain, a round
        trip to every template and agent, is skipped."""
        if sends_total() != self._synced_at:
            Runtime.current().drain_output(OUTPUT_DRAIN_S)
        self.sink.write_waiting()

    def close(self) -> None:
        """Take out everything this session installed (the kernel is shutting down, or the
        extension is unloaded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for event, fn in self._events:
            try:
                self.shell.events.unregister(event, fn)
            except ValueError:
                pass
        self._events = []
        self.watchdog.set(None)
        self.watchdog.cell_ends()
        self.panel.close()
        self.restarts.close()
        self.pdb.close()
        self.jobs.close()
        for live in self.live.values():
            live.close()
        self.live = {}
        self.sink.close()
        self.record.close()

    def note(self, _info=None) -> None:
        """Rewrite this kernel's record for ``monarch-kernel ls`` if its meshes or jobs changed."""
        self.jobs.adopt()  # a job the cell made with the API is this kernel's too
        try:
            self.record.note(self)
        except OSError as e:  # a full disk, say: the notebook goes on without it
            log.warning("monarch_kernel: cannot write this kernel's record for monarch-kernel ls: %s", e)

    def add(self, procs, consoles, host=None) -> None:
        """A mesh this session now drives; it becomes current."""
        self.meshes[procs.name] = (procs, consoles)
        if host is not None:
            self.hosts[procs.name] = host
        self.current = procs.name
        self.note()

    def stop(self, name: str) -> list[str]:
        """End mesh ``name`` (a detached one through its host process) and drop it; what to
        tell the user, a line each."""
        procs, _c = self.get(name)
        proxy.forget_mesh(self.shell, procs.name)
        host = self.hosts.get(procs.name)
        ranks = counted(len(procs), "rank")
        if host is None:
            procs.stop().get(timeout=30)
            said = [f"stopped mesh {procs.name}: its {ranks} ended"]
        elif detached.stop(procs.name, host):
            said = [f"stopped detached mesh {procs.name!r}: its {ranks} and its host process ended"]
        else:
            said = [f"detached mesh {procs.name!r} was already gone: its host process is no longer running"]
        self.remove(procs.name)
        job = self.jobs.meshes.pop(procs.name, None)
        if job is not None and job not in self.jobs.meshes.values():
            said.append(f"job {job} keeps its hosts for the next  %mesh spawn --job {job};  "
                        f"%mesh kill-job {job} frees them")
        return said

    def remove(self, name: str) -> None:
        """Mesh ``name`` stopped (or its job went): its status widget says so, once."""
        self.meshes.pop(name, None)
        self.respawn.forget(name)
        self.last_lines.forget(name)
        self.hosts.pop(name, None)
        if self.current == name:
            self.current = next(iter(self.meshes), None)
        live = self.live.pop(name, None)
        if live is not None:
            live.refresh()  # its last word: every rank stopped
        self.note()

    def run_in_cell(self, fn) -> None:
        """Run ``fn`` in the running cell's context (the last cell's between cells), so what it
        prints lands there (``PdbHost.run_in_cell``)."""
        ctx = self.sink.context
        ctx.run(fn) if ctx is not None else fn()

    def cell_label(self, filename: str) -> str | None:
        """``Cell In[7]`` for the file cell 7 was compiled under, as IPython names it (``PdbHost``)."""
        return cell_label(filename)

    def debugger_event(self, kind: str, mesh: str, rank: int, detail: str) -> None:
        """A rank stopped in pdb or went on: into the history (``PdbHost.debugger_event``)."""
        history.record_event(mesh, kind, rank=rank, detail=detail)

    def _remember_cell(self, info=None) -> None:
        self.raw_cell = getattr(info, "raw_cell", "") or ""
        self._sends_at_cell, self._synced_at = sends_total(), -1

    def cell_file(self, line: str, body: str) -> tuple[str, str, int]:
        """(the whole cell, the file name it compiles under, lines before ``body``).

        The name is the one JupyterLab's ``dumpCell`` gives the cell, so breakpoints set in
        the notebook land on the rank; line numbers count the ``%%mesh`` line.
        """
        raw, stripped = self.raw_cell, body.rstrip()
        start = raw.rfind(stripped) if stripped else -1
        if start < 0 or raw[start:].rstrip() != stripped:
            raw, start = f"%%mesh {line}".rstrip() + "\n" + body, len(f"%%mesh {line}".rstrip()) + 1
        try:
            from ipykernel.compiler import get_file_name
        except ImportError:  # IPython without ipykernel: no debugger to agree with
            return raw, f"<mesh-cell-{abs(hash(raw)):x}>", raw.count("\n", 0, start)
        filename = get_file_name(raw)
        self.cells.remember(filename, raw)
        return raw, filename, raw.count("\n", 0, start)

    def restart(self, name: str, ranks: list[int] | None = None):
        """Replace the dead and not-responding ranks (or ``ranks``) of mesh ``name``, each
        with a fresh console: ``ProcMesh.restart``, here or in a detached mesh's host process.
        Returns its ``Restarted``; a live rank that responds is a ``UsageError``."""
        procs, consoles = self.get(name)
        host = self.hosts.get(procs.name)
        try:
            if host is None:
                return procs.restart(ranks, [(consoles, Console, (), {})])
            done = host.restart.call_one(ranks).get(timeout=120)
            rt = Runtime.current()  # the host told us of the deaths; it revives only its own meshes' view
            rt.forget_deaths(procs.ref.id, done.ranks)
            return done
        except ValueError as e:
            raise UsageError(str(e)) from None
        except ActorError as e:
            if isinstance(e.__cause__, ValueError):  # the host refused the ranks
                raise UsageError(str(e.__cause__)) from None
            raise

    def get(self, name: str | None = None):
        name = name or self.current
        if name is None:
            raise UsageError("no mesh yet: start one with  procs = %mesh spawn -n 4")
        if name not in self.meshes:
            raise UsageError(f"no mesh named {name!r}; %mesh list shows: {', '.join(self.meshes) or 'none'}")
        return self.meshes[name]


def _keep_cell_filenames(rt) -> list:
    """Code defined in notebook cells keeps its cell's file name when it travels to a rank.

    cloudpickle (3.x) renames every by-value code object to ``<dynamic-code>``, so on a rank
    neither pdb nor debugpy could tell which cell a notebook-defined function came from.
    cloudpickle has no public hook for code objects, so its reducer table entry is patched,
    through the runtime's hooks (undone when the session closes), for code compiled from
    cells (ipykernel's temp-file names) only.
    """
    try:
        from ipykernel.compiler import get_tmp_directory
    except ImportError:  # no ipykernel: cells have no file names to keep
        return []
    import os
    import types

    import cloudpickle

    table = cloudpickle.Pickler._dispatch_table
    original = table[types.CodeType]
    prefix = get_tmp_directory() + os.sep

    def code_reduce(code: types.CodeType):
        rebuild, args = original(code)
        if code.co_filename.startswith(prefix):
            args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
        return rebuild, args

    return [rt.hooks.patch(table, types.CodeType, code_reduce)]
