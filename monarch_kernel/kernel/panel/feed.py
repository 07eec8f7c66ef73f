"""The kernel's side of JupyterLab's Mesh panel: a comm (target ``monarch_kernel.panel``)
that sends the panel every mesh and rank of this kernel whenever something changes, and
runs the panel's buttons (interrupt, restart, debug, stop, spawn, the log).

It is event driven and must stay so: an idle kernel sends nothing (no timer runs while no
cell executes and no rank is busy); while ranks run it sends at most one update per
``MIN_GAP_S``, and one per ``TICK_S`` for CPU figures.  It uses the session, the public
mesh API, the runtime's hooks and the comm manager only.  Runs in the kernel.

A mesh over ``status.SUMMARY_OVER`` ranks is summarised as ``%mesh status`` summarises it:
its state carries counts by state and rows for the ranks that are not idle (dead, busy,
stopped, not responding) only, and only those rows are measured.  A panel's ``table``
request (the "show all ranks" toggle) expands it: every state sent then carries every row
of that mesh, for every panel on this kernel, until a panel asks for the summary again or
the last panel closes.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import threading
import time
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from ...actor.errors import ActorError
from ...debug.controller import proxy
from ...detached import listing
from ...runtime import Runtime, config, counted, diagnostics, rank_label, rejects
from .messages import COMM_TARGET, LogLines, MessageError, Metrics, PanelState, Reply, Request
from .view import PanelView, RankLog

if TYPE_CHECKING:
    from ..session import MeshSession

log = logging.getLogger(__name__)
TICK_S = config.seconds("panel_tick")
MIN_GAP_S = config.seconds("panel_min_gap")
COALESCE_S = config.seconds("panel_coalesce")
METRIC_POINTS = 120  # samples per rank the panel's sparklines show (2 minutes at its poll of one a second)


class PanelFeed:
    """The comms of the panels looking at this kernel, and what they are sent."""

    def __init__(self, session: MeshSession):
        self.session = session
        self.shell = session.shell
        self.log = RankLog()
        self.view = PanelView(session, self.log)  # builds what is sent
        self.comms: list = []
        self.running = False  # a cell executes
        self.cells = 0  # cells begun (each state carries it: the panel's notes about "now" go with the next)
        self._notices: list[str] = []  # what the panel did while no cell ran: said when the next begins
        self.sent = 0  # updates sent (the benchmark reads it)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._last: dict | None = None
        self._last_sent_at = 0.0
        self._ticking = False
        self._thread: threading.Thread | None = None
        self._attached: set[str] = set()  # detached meshes marked as attached to this kernel
        self._manager = getattr(getattr(self.shell, "kernel", None), "comm_manager", None)
        self._handles: list = []
        self._events = [("pre_run_cell", self._cell_starts), ("post_run_cell", self._cell_ends)]

    # ------------------------------------------------------------ installing

    def install(self) -> None:
        """Register the comm target and the hooks; undone by ``close()``."""
        for event, fn in self._events:
            self.shell.events.register(event, fn)
        self.session.sink.watchers.append(self._line)
        self._handles.append(Runtime.current().hooks.death.install(self._death))
        if self._manager is not None:
            self._manager.register_target(COMM_TARGET, self._open)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        for event, fn in self._events:
            try:
                self.shell.events.unregister(event, fn)
            except ValueError:
                pass
        if self._line in self.session.sink.watchers:
            self.session.sink.watchers.remove(self._line)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._manager is not None:
            self._manager.unregister_target(COMM_TARGET, self._open)
        for comm in list(self.comms):
            try:
                comm.close()
            except Exception:  # noqa: BLE001  (the kernel is going away; its iopub may be closed)
                pass
        self.comms = []
        for name in list(self._attached):
            listing.unmark_attached(name)
        self._attached.clear()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def connected(self) -> bool:
        """Whether a panel is looking at this kernel (rich rank output then lays out as a grid)."""
        return bool(self.comms)

    # ------------------------------------------------------------ events (any thread; cheap)

    def changed(self) -> None:
        """Something the panel shows may have changed: an update follows (if it did)."""
        self._wake.set()

    def event(self, mesh: str, rank: int, line: str) -> None:
        """A lifecycle event of ``mesh`` (a restart by its policy): into its log, as a line of
        stream "event", and the panel updated.  Any thread."""
        self.log.add(mesh, rank, "event", line)
        self.changed()

    def _line(self, mesh: str, rank: int, stream: str, line: str) -> None:  # on the IO thread
        self.log.add(mesh, rank, stream, line)
        if self.comms and not self._wake.is_set():
            self._wake.set()

    def _death(self, mesh_id: str, rank: int, info) -> None:  # on the IO thread
        self._wake.set()

    def _cell_starts(self, info=None, *_a) -> None:
        self.running = True
        self.cells += 1
        if getattr(info, "store_history", False) and not getattr(info, "silent", False):  # a notebook's cell
            with self._lock:
                notices, self._notices = self._notices, []
            for line in notices:  # pre_run_cell: this prints at the top of the cell that begins
                print(line, flush=True)
        self._wake.set()

    def _cell_ends(self, *_a) -> None:
        self.running = False
        self._sync_attached()
        self._wake.set()

    def _sync_attached(self) -> None:
        """Say in Jupyter's runtime directory which detached meshes this kernel has attached
        (the server extension shows it); a cheap dict comparison after each cell."""
        now = set(self.session.hosts)
        for name in now - self._attached:
            listing.mark_attached(name)
        for name in self._attached - now:
            listing.unmark_attached(name)
        self._attached = now

    def tell_notebook(self, line: str, *, later: bool = True) -> None:
        """Say in the notebook what a button did: in the running cell now, or (``later``) at
        the top of the next cell, so a mesh the panel made or changed is never unheard of."""
        if self.running:
            self.session.run_in_cell(lambda: print(line, flush=True))
        elif later:
            with self._lock:
                self._notices.append(line)

    # ------------------------------------------------------------ the comm

    def _open(self, comm, _msg) -> None:
        comm.on_msg(lambda msg: self._message(comm, msg))
        comm.on_close(lambda _msg: self._closed_comm(comm))
        with self._lock:
            self.comms.append(comm)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mesh-panel", daemon=True)
                self._thread.start()
        self._publish(comm, self.state().encode())

    def _closed_comm(self, comm) -> None:
        with self._lock:
            if comm in self.comms:
                self.comms.remove(comm)
            if not self.comms:
                self.view.expanded.clear()  # no panel left to show a full table

    def _send_to(self, comm, data: dict) -> None:
        try:
            comm.send(data)
        except Exception:  # noqa: BLE001  (a closed frontend's comm; it is dropped)
            self._closed_comm(comm)

    def _publish(self, comm, data: dict) -> None:
        """Send an update with no parent message.  ``comm.send`` would tie it to the running
        cell's, and ipykernel then routes the panel's next request to that cell's (busy)
        shell instead of the subshell the panel sends on; replies keep using ``comm.send``."""
        kernel = getattr(self.shell, "kernel", None)
        if kernel is None:
            self._send_to(comm, data)
            return
        try:
            kernel.session.send(kernel.iopub_socket, "comm_msg", {"data": data, "comm_id": comm.comm_id},
                                parent={}, ident=comm.topic)
        except Exception:  # noqa: BLE001  (the kernel is shutting down: its iopub is closed)
            self._closed_comm(comm)

    def _broadcast(self, data: dict) -> None:
        for comm in list(self.comms):
            self._publish(comm, data)
        self.sent += 1

    def _message(self, comm, msg) -> None:
        data = msg.get("content", {}).get("data", {})
        try:
            req = Request.decode(data)
        except MessageError as e:
            rejects.count("panel", "malformed", str(e))
            self._send_to(comm, Reply(data.get("id", 0) if isinstance(data, dict) else 0, False, str(e)).encode())
            return
        if req.action == "log":
            self._send_to(comm, LogLines(req.mesh, self.log.lines(req.mesh, req.since), req.since).encode())
            return
        if req.action == "metrics":  # a panel showing sparklines polls: sample now, answer with the history
            self._send_to(comm, self._metrics(req).encode())
            return
        if req.action in ("hello", "refresh"):
            self._last = None
            self._publish(comm, self.state().encode())
            return
        try:
            message = getattr(self, f"_do_{req.action}")(req)
            report = ""
            if isinstance(message, tuple):  # (the sentence, a report for a tab of its own)
                message, report = message
            reply = Reply(req.id, True, message or "", report)
        except (UsageError, ActorError, TimeoutError, ValueError, RuntimeError, IndexError) as e:
            reply = Reply(req.id, False, str(e))
        self._send_to(comm, reply.encode())
        self._last = None
        self.changed()

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        while not self._closed:
            woke = self._wake.wait(TICK_S if self._ticking else None)
            if self._closed:
                return
            if woke:
                time.sleep(COALESCE_S)
                gap = MIN_GAP_S - (time.monotonic() - self._last_sent_at)
                if gap > 0:
                    time.sleep(gap)
            self._wake.clear()
            if not self.comms:
                self._ticking = False
                continue
            try:
                state = self.state()
            except Exception as e:  # noqa: BLE001  (a mesh mid-stop; the next event tries again)
                self._ticking = True
                log.error("monarch_kernel: the mesh panel's update failed: %r", e, extra=diagnostics.PROCESS_STDERR)
                continue
            data = state.encode()
            self._ticking = state.running or any(m.counts.get("busy") for m in state.meshes)
            if data != self._last:
                self._last = data
                self._last_sent_at = time.monotonic()
                self._broadcast(data)

    def state(self) -> PanelState:
        """Every mesh and job of this kernel as the panel shows it now."""
        return self.view.state(self.running, self.cells)

    # ------------------------------------------------------------ the buttons

    def _procs(self, req: Request):
        return self.session.get(req.mesh or None)

    def _do_interrupt(self, req: Request) -> str:
        procs, consoles = self._procs(req)
        ranks = [req.rank] if req.rank is not None else None
        procs.interrupt(consoles, ranks, wait=2.0)
        where = "" if procs.name == self.session.current else f" of {procs.name}"
        self.tell_notebook(f"{rank_label(ranks or range(len(procs)))}{where} interrupted from the Mesh panel",
                           later=False)  # an idle rank's interrupt changes nothing a cell would see
        return f"interrupted {rank_label(ranks, brackets=False) if ranks else 'every rank'} of {procs.name}"

    def _do_restart(self, req: Request) -> str:
        procs, _consoles = self._procs(req)
        ranks = req.ranks if req.ranks is not None else ([req.rank] if req.rank is not None else None)
        done = self.session.restart(procs.name, ranks)  # ProcMesh.restart: the one restart path
        if not done.ranks:
            return f"no dead ranks in {procs.name}"
        killed = f" ({rank_label(done.killed, brackets=False)} not responding: killed first)" if done.killed else ""
        return f"restarted {rank_label(done.ranks, brackets=False)} of {procs.name} with fresh namespaces{killed}"

    def _do_stacks(self, req: Request) -> tuple[str, str]:
        """The grouped stacks of the mesh (or of one rank), while a cell may be running: the
        panel's comm has its own thread, and py-spy reads the ranks from outside."""
        procs, _consoles = self._procs(req)
        ranks = [req.rank] if req.rank is not None else req.ranks
        report = procs.stacks(ranks).name_frames(self.session.cells.frame)
        odd = report.odd_ranks()
        return (f"stacks of {procs.name}: {counted(len(report.groups), 'group')}"
                + (f", {rank_label(odd, brackets=False)} differ{'s' if len(odd) == 1 else ''} from the rest"
                   if odd else ""), repr(report))

    def _metrics(self, req: Request) -> Metrics:
        try:
            procs, _consoles = self._procs(req)
        except UsageError:
            return Metrics(req.mesh, {})
        self.session.metrics.sample(procs)
        series = {str(r): {"cpu": [p.cpu for p in pts], "rss_mib": [p.rss_mib for p in pts],
                           "gpu": [p.gpu for p in pts], "gpu_mib": [p.gpu_mib for p in pts]}
                  for r in procs.shape.ranks for pts in [self.session.metrics.series(procs.name, r)[-METRIC_POINTS:]]}
        return Metrics(procs.name, series)

    def _do_debug(self, req: Request) -> str:
        procs, _consoles = self._procs(req)
        if req.rank is None:
            raise UsageError("debug needs a rank")
        self.session.current = procs.name
        proxy.command(self.session, self.shell, [str(req.rank)])
        return (f"JupyterLab's debugger now debugs rank {req.rank} of {procs.name}: switch the debugger on "
                f"(the bug icon) and set breakpoints in %%mesh cells")

    def _do_table(self, req: Request) -> str:
        """The full table of a mesh over ``status.SUMMARY_OVER`` ranks (``full``), kept in
        every state sent until the panel asks for the summary again (or its last panel closes)."""
        procs, _c = self._procs(req)
        if req.full:
            self.view.expanded.add(procs.name)
            return f"every rank of {procs.name} is listed ({counted(len(procs), 'row')})"
        self.view.expanded.discard(procs.name)
        return f"{procs.name} is summarised: ranks that are not idle are listed"

    def _do_use(self, req: Request) -> str:
        procs, _c = self._procs(req)
        self.session.current = procs.name
        self.tell_notebook(f"%mesh: {procs.name} made current from the Mesh panel: %%mesh cells run on its "
                           f"{len(procs)} rank{'s' if len(procs) != 1 else ''}")
        return f"{procs.name} is the current mesh"

    def _do_stop(self, req: Request) -> str:
        procs, _c = self._procs(req)
        self.shell.run_line_magic("mesh", f"stop {procs.name}")
        self.log.forget(procs.name)
        self.view.expanded.discard(procs.name)
        self._sync_attached()
        now = self.session.current
        self.tell_notebook(f"%mesh: mesh {procs.name} stopped from the Mesh panel"
                           + (f"; {now} is the current mesh" if now else "; no mesh is left"))
        return f"stopped {procs.name}"

    def _do_spawn(self, req: Request) -> str:
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
        self._sync_attached()
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


def feed(session: MeshSession) -> PanelFeed:
    """The session's panel feed, installed."""
    f = PanelFeed(session)
    f.install()
    return f


__all__: list[Any] = ["PanelFeed", "feed", "fresh_name", "spawn_line"]
