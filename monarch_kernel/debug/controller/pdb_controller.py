"""Distributed pdb, kernel side: ranks stopped in ``breakpoint()`` report to ``PdbHub``, and
the notebook talks to them over Jupyter's stdin channel (``input()`` -> ``input_request``).

Runs in the kernel.  One rank stopped: its pdb prompt appears in the cell.  Several: the
``(mesh pdb)`` prompt (``pdb_prompt.py``) chooses.  It never answers for the user, except to
continue a rank when the frontend has no stdin (a headless run must not hang), and every
hook it installs is removed by ``close()``.
"""

from __future__ import annotations

import linecache
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from IPython.core.error import StdinNotImplementedError

from ...actor.port import Channel, Port, PortReceiver
from ...runtime import ActorError, MeshStopped, Runtime, SendFailed, config, rejects
from ..messages import Ended, Prompt, Reply, Resumed, Stopped, decode
from .pdb_prompt import PdbCommands, describe
from .rank_stop import RankStop

ANNOUNCE_WINDOW_S = config.seconds("pdb_announce_window")
RECEIVE_POLL_S = config.seconds("pdb_receive_poll")
TELL_TIMEOUT_S = config.seconds("pdb_tell_timeout")


class PdbHost(Protocol):
    """What ``PdbHub`` needs of the kernel that makes it (the kernel's ``MeshSession``); the
    hub reads nothing else of the kernel."""

    #: The meshes the kernel spawned or attached, by name: ``(ProcMesh, console ActorMesh)``;
    #: their consoles set pdb up on their ranks.
    meshes: Mapping[str, tuple]
    #: True while the kernel is spawning a mesh (it sets pdb up through the console itself).
    spawning: bool

    def run_in_cell(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` so that what it prints lands in the running cell (or the last one)."""

    def cell_label(self, filename: str) -> str | None:
        """``Cell In[7]`` for the file a notebook cell was compiled under; None for others."""

    def debugger_event(self, kind: str, mesh: str, rank: int, detail: str) -> None:
        """A rank stopped in pdb (``debugger_stop``) or went on (``debugger_continue``); optional."""


class ServeWhileWaiting:
    """The kernel's ``hooks.wait``: a plain cell blocked on a ``Future`` (say
    ``actors.step.call().get()``) serves a rank that stops in pdb meanwhile, at that cell's
    prompt, instead of leaving both waiting on each other."""

    def __init__(self, hub: PdbHub):
        self.hub = hub

    def pending(self) -> bool:
        hub = self.hub
        return (threading.current_thread() is threading.main_thread() and not hub.serving
                and not hub.cell_running and bool(hub.waiting()))

    def run(self, completion) -> None:
        self.hub.serve(done=completion.done)


class PdbHub:
    """Receives the ranks' pdb messages (on its own thread) and serves them at the prompt.

    Made by the kernel with a ``PdbHost`` (its ``MeshSession``); installs the runtime's wait
    and spawned hooks until ``close()``.
    """

    def __init__(self, host: PdbHost):
        self.host = host
        self.api_meshes: dict[str, tuple] = {}  # name -> (ProcMesh, PdbSetup mesh): spawned in cells
        self.port: Port[Any]
        self._receiver: PortReceiver[Any]
        self.port, self._receiver = Channel.open()  # the ranks' pdb messages
        self.post_mortem = False
        self.stops: dict[tuple, RankStop] = {}
        self.attached: tuple | None = None  # the key of the RankStop whose prompt we show
        self.chose_detach = False  # the user left a rank's prompt: do not go back by itself
        self.serving = False  # a cell (or %mesh pdb) is at the prompt for them
        self.cell_running = False  # a %%mesh cell runs: it will serve stops itself
        self.commands = PdbCommands(self)
        self._fresh: list[RankStop] = []  # stopped, not yet announced
        self._timer: threading.Timer | None = None
        self._cv = threading.Condition()
        self._handles: list = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="mesh-pdb", daemon=True)
        self._thread.start()
        self.install()

    def install(self) -> None:
        """Serve stops from cells blocked on a Future (``hooks.wait``) and set up pdb on
        meshes spawned with the API (``hooks.spawned``); once."""
        if self._handles or self._closed.is_set():
            return
        hooks = Runtime.current().hooks
        self._handles = [hooks.wait.install(ServeWhileWaiting(self)), hooks.spawned.install(self.mesh_spawned)]

    def close(self) -> None:
        """Remove every hook this hub installed and stop receiving (the kernel is ending)."""
        self._closed.set()
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        with self._cv:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None
        self._thread.join(timeout=2 * RECEIVE_POLL_S + 1)
        rt = Runtime.existing()
        if rt is not None:
            rt.close_port(self.port.port_id)

    # ------------------------------------------------------------ messages from ranks

    def _receive(self) -> None:
        pending = None  # one Future at a time: a timed-out wait keeps its place in the queue
        while not self._closed.is_set():
            if pending is None:
                pending = self._receiver.recv()
            try:
                raw = pending.get(timeout=RECEIVE_POLL_S)
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001  (an error sent, or frames that do not load: skip it)
                pending = None
                continue
            pending = None
            try:
                msg = decode(raw)
            except ValueError as e:  # a malformed message: skip it, keep listening
                rejects.count("pdb", "malformed", str(e))
                continue
            self._on_message(msg)

    def _on_message(self, msg) -> None:
        if isinstance(msg, Stopped):
            stop = RankStop(msg, names=self.host.cell_label)
            with self._cv:
                self.stops[stop.key] = stop
            self._send(stop, None, self._sources(msg.missing))
            self._soon_announce(stop)
            self._event("debugger_stop", stop, stop.place())
            return
        key = (msg.mesh, msg.rank, msg.session)
        with self._cv:
            known = self.stops.get(key)
            if known is None:
                return
            stop = known
            stop.output.append(msg.output)
            again = False
            if isinstance(msg, Prompt):
                again = stop.state == "running"  # stopped again at a breakpoint: say so
                stop.state, stop.lineno, stop.filename = "waiting", msg.lineno, msg.filename
            elif isinstance(msg, Resumed):
                stop.state = "stepping" if msg.stepping else "running"
            elif isinstance(msg, Ended):
                self._event("debugger_continue", stop, "")
                stop.state = "ended"
                self.stops.pop(key, None)
                if self.attached == key:
                    self.attached = None
                if stop.output and "".join(stop.output).strip() and not self.serving:
                    self.write(stop.take_output())
            self._cv.notify_all()
        if again:
            self._soon_announce(stop)

    def _soon_announce(self, stop: RankStop) -> None:
        """Say which ranks stopped, once the ones stopping together have arrived."""
        with self._cv:
            self._fresh.append(stop)
            if self._timer is not None or self._closed.is_set():
                return
            self._timer = threading.Timer(ANNOUNCE_WINDOW_S, self.announce)
            self._timer.daemon = True
            self._timer.start()

    def _event(self, kind: str, stop: RankStop, detail: str) -> None:
        (getattr(self.host, "debugger_event", None) or (lambda *_a: None))(kind, stop.where.mesh, stop.rank, detail)

    def announce(self) -> None:
        """Print "rank 3 stopped at cell line 4" for stops not yet told (any thread)."""
        with self._cv:
            fresh, self._fresh = self._fresh, []
            if self._timer is not None:
                self._timer.cancel()
            self._timer = None
        groups: dict[str, list[RankStop]] = {}
        for s in fresh:
            groups.setdefault(s.place() + s.where.reason + s.where.error, []).append(s)
        for group in groups.values():
            hint = ""
            if not (self.serving or self.cell_running):
                hint = f"; type  %mesh pdb attach {group[0].rank}  to debug it"
            self.write(describe(group) + hint + "\n")

    @staticmethod
    def _sources(files) -> dict:
        """The kernel's copy of sources a rank lacks (cells that defined its code)."""
        out = {}
        for name in files:
            lines = linecache.getlines(name)
            if lines:
                out[name] = "".join(lines)
        return out

    def write(self, text: str) -> None:
        """Print into the running cell (or the last one), from any thread."""

        def write():
            sys.stdout.write(text)
            sys.stdout.flush()

        self.host.run_in_cell(write)

    def _send(self, stop: RankStop, line: str | None, sources: dict | None = None) -> None:
        entry = self.mesh(stop.where.mesh)
        port = stop.where.reply
        try:
            if port is None:
                raise LookupError(f"rank {stop.rank} left no port to answer it on")
            if entry is None:
                raise LookupError(f"mesh '{stop.where.mesh}' is no longer attached")
            # Signed with the mesh's key: a detached mesh's ranks know no other.
            port.send(Reply(line, sources or {}).encode(), mesh_id=entry[0].ref.id)
        except Exception as e:  # the mesh is gone: so is the session
            stop.output.append(f"pdb on rank {stop.rank}: {e}\n")
            self._drop(stop)

    def _drop(self, stop: RankStop) -> None:
        with self._cv:
            stop.state = "ended"
            self.stops.pop(stop.key, None)
            if self.attached == stop.key:
                self.attached = None
            self._cv.notify_all()

    def mesh(self, name: str):
        """(ProcMesh, actors) of the mesh ``name``: %mesh spawn's, or one spawned in a cell."""
        return self.host.meshes.get(name) or self.api_meshes.get(name)

    def rank_count(self, stops=()) -> int:
        """How many ranks the meshes of ``stops`` have (every known mesh's, with none): what
        a rank spec at the prompt is parsed against."""
        names = {s.where.mesh for s in stops} or set(self.host.meshes) | set(self.api_meshes)
        sizes = [len(e[0]) for e in map(self.mesh, names) if e is not None]
        return max(sizes + [s.rank + 1 for s in stops], default=0)

    def _alive(self, stop: RankStop) -> bool:
        entry = self.mesh(stop.where.mesh)
        if entry is None:
            return False
        return Runtime.current().death(entry[0].ref.id, stop.rank) is None

    # ------------------------------------------------------------ the prompt

    def waiting(self) -> list[RankStop]:
        """The stops at a pdb prompt now, in (mesh, rank, session) order."""
        with self._cv:
            return sorted((s for s in self.stops.values() if s.state == "waiting"), key=lambda s: s.key)

    def busy(self) -> bool:
        """A rank stopped in pdb, or running a command it was sent (n, s) and about to stop."""
        with self._cv:
            return any(s.state in ("waiting", "sent", "stepping", "starting") for s in self.stops.values())

    def serve(self, done=lambda: False, auto_attach: bool = True, leave_on_detach: bool = False) -> None:
        """Talk to stopped ranks at the notebook's stdin until none is stopped or ``done()``.

        ``auto_attach``: with one rank stopped, go straight to its pdb prompt (cells on one
        rank); otherwise the ``(mesh pdb)`` prompt chooses.  ``KeyboardInterrupt`` (the
        stop button) propagates: the caller interrupts the ranks.
        """
        self.serving = True
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: not self._stepping_only() or done(), timeout=0.1)
                waiting = self.waiting()
                if not waiting:
                    if self.busy() and not done():
                        continue
                    return
                self.announce()
                target = self._target(waiting, auto_attach)
                try:
                    if target is not None:
                        self._rank_prompt(target)
                    elif self.commands.prompt(waiting) == "leave" and leave_on_detach:
                        return
                except StdinNotImplementedError:
                    self.write("this frontend cannot send input; continuing the stopped ranks\n")
                    for s in waiting:
                        self.command(s, "c")
        finally:
            self.serving = False
            if not self.stops:
                self.attached, self.chose_detach = None, False

    def _stepping_only(self) -> bool:
        states = [s.state for s in self.stops.values()]
        return bool(states) and "waiting" not in states and any(
            st in ("sent", "stepping", "starting") for st in states)

    def _target(self, waiting: list[RankStop], auto_attach: bool) -> RankStop | None:
        by_key = {s.key: s for s in waiting}
        if self.attached in by_key:
            return by_key[self.attached]
        if self.attached is not None and self.attached in self.stops:
            return None  # the attached rank is busy; others wait at the (mesh pdb) prompt
        if auto_attach and len(waiting) == 1 and not self.chose_detach:
            self.attached = waiting[0].key
            return waiting[0]
        return None

    def _rank_prompt(self, stop: RankStop) -> None:
        text = stop.take_output()
        if text:
            self.write(text if text.endswith("\n") else text + "\n")
        line = input(f"(Pdb rank {stop.rank}) ")
        if line.strip() == "detach":
            self.attached, self.chose_detach = None, True
            return
        self.command(stop, line)
        if stop.state != "waiting":  # it ran on (or ended): show what it printed last
            text = stop.take_output()
            if text.strip():
                self.write(text if text.endswith("\n") else text + "\n")

    def command(self, stop: RankStop, line: str) -> None:
        """Send one pdb command to a stopped rank; return once it answered (or died)."""
        with self._cv:
            stop.state = "sent"
        self._send(stop, line)
        with self._cv:
            while stop.state == "sent":
                self._cv.wait(0.1)  # an interrupt gets in between waits
                if stop.state == "sent" and not self._alive(stop):
                    stop.output.append(f"rank {stop.rank} died\n")
                    stop.state = "ended"
                    self.stops.pop(stop.key, None)

    def cast(self, stops: list[RankStop], pdb_cmd: str) -> None:
        """Send one command to several stopped ranks at once; print each rank's answer."""
        threads = [threading.Thread(target=self.command, args=(s, pdb_cmd), daemon=True) for s in stops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in stops:
            text = s.take_output().rstrip("\n")
            if text:
                self.write("".join(f"[rank {s.rank}] {ln}\n" for ln in text.splitlines()))

    # ------------------------------------------------------------ what the magics call

    def magic(self, args: list[str]) -> None:
        """``%mesh pdb [list | attach R | cast RANKS CMD | continue | --post-mortem on|off]``."""
        self.commands.magic(args)

    def tell_ranks(self, mesh: str) -> None:
        """Where the mesh's ranks report pdb stops (this kernel), and the post-mortem setting.
        Waits until the ranks have it: the next cell's first call, to another actor with a
        worker of its own, may stop at once (a rank that died meanwhile is supervision's)."""
        entry = self.mesh(mesh)  # (on a thread of its own: the mesh may be stopped meanwhile)
        if entry is None:
            return
        try:
            entry[1].debug_setup.call(self.port, self.post_mortem).get(timeout=TELL_TIMEOUT_S)
        except (ActorError, MeshStopped, SendFailed, TimeoutError):
            pass  # the ranks that could take it have; the others cannot stop in pdb anyway

    def mesh_spawned(self, procs) -> None:
        """``hooks.spawned``: a mesh spawned in a cell (not by ``%mesh spawn``) gets a
        ``PdbSetup`` actor, so its ranks' pdb reports here."""
        if self.host.spawning or procs.name in self.host.meshes:
            return
        from ..rank.pdb_rank import PdbSetup

        setup = procs.spawn("mesh_pdb", PdbSetup, self.port, self.post_mortem)
        # Spawning is asynchronous: wait, so that a breakpoint in the user's first call (on
        # another actor, with a worker of its own) already finds pdb set up on its rank.
        setup.initialized().get(timeout=60)
        self.api_meshes[procs.name] = (procs, setup)

    def cell_options(self) -> dict:
        """What a %%mesh cell's console needs: ``pdb_port`` and ``post_mortem``."""
        return {"pdb_port": self.port, "post_mortem": self.post_mortem}
