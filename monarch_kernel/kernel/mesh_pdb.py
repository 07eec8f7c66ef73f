"""Distributed pdb, controller side: ranks stopped in ``breakpoint()`` report here, and the
notebook talks to them over Jupyter's stdin channel (``input()`` -> ``input_request``).

One rank stopped: its pdb prompt appears in the cell.  Several: a ``(mesh pdb)`` prompt
lists them and takes ``attach R``, ``cast RANKS CMD`` and ``continue``, as Monarch's
debugger does.  It never answers for the user, except to continue a rank when the
frontend has no stdin (a headless run must not hang).
"""

from __future__ import annotations

import linecache
import threading
import time
from dataclasses import dataclass, field

from IPython.core.error import StdinNotImplementedError, UsageError

from ..actor.port import Channel
from ..runtime.envelope import Part, Status
from ..runtime.process import Runtime
from ..runtime.serialize import dumps
from .output import rank_label
from .rank_pdb import Prompt, Resumed, Stopped

ANNOUNCE_WINDOW_S = 0.2  # ranks stopping within this window are announced together

HELP = """\
(mesh pdb) commands:
  list                 the stopped ranks and where they stopped
  attach R             talk to rank R's pdb (type  detach  there to come back)
  cast RANKS CMD       send one pdb command to several ranks (RANKS: 0 | 0-3 | 0,2)
  continue             continue every stopped rank
  help                 this text"""


@dataclass
class RankStop:
    """One pdb session on one rank, as the controller sees it."""

    where: Stopped
    state: str = "starting"  # starting | waiting | sent | stepping | running | ended
    output: list = field(default_factory=list)
    lineno: int = 0
    filename: str = ""

    @property
    def rank(self) -> int:
        return self.where.rank

    @property
    def key(self) -> tuple:
        return (self.where.mesh, self.where.rank, self.where.session)

    def place(self) -> str:
        line = self.lineno or self.where.lineno
        if (self.filename or self.where.filename) == self.where.filename and self.where.cell:
            return f"cell line {line}"
        return f"{self.filename or self.where.filename}:{line}"

    def take_output(self) -> str:
        text, self.output = "".join(self.output), []
        return text


class ServeWhileWaiting:
    """``Runtime.wait_hook`` in the kernel: a plain cell blocked on a ``Future`` (say
    ``actors.step.call().get()``) serves a rank that stops in pdb meanwhile, at that cell's
    prompt, instead of leaving both waiting on each other."""

    def __init__(self, hub: "PdbHub"):
        self.hub = hub

    def pending(self) -> bool:
        hub = self.hub
        return (threading.current_thread() is threading.main_thread() and not hub.serving
                and not hub.cell_running and bool(hub.waiting()))

    def run(self, completion) -> None:
        self.hub.serve(done=completion.done)


class PdbHub:
    """Receives the ranks' pdb messages (on its own thread) and serves them at the prompt."""

    def __init__(self, session):
        self.session = session
        self.api_meshes: dict[str, tuple] = {}  # name -> (ProcMesh, PdbSetup mesh): spawned in cells
        self.port, self._receiver = Channel.open()
        self.post_mortem = False
        self.stops: dict[tuple, RankStop] = {}
        self.attached: tuple | None = None
        self._chose_detach = False
        self.serving = False  # a cell (or %mesh pdb) is at the prompt for them
        self.cell_running = False  # a %%mesh cell runs: it will serve stops itself
        self._fresh: list[RankStop] = []  # stopped, not yet announced
        self._timer: threading.Timer | None = None
        self._cv = threading.Condition()
        threading.Thread(target=self._receive, name="mesh-pdb", daemon=True).start()

    # ------------------------------------------------------------ messages from ranks

    def _receive(self) -> None:
        while True:
            try:
                msg = self._receiver.recv().get()
            except Exception:  # a malformed message: skip it, keep listening
                time.sleep(0.1)
                continue
            self._on_message(msg)

    def _on_message(self, msg) -> None:
        if isinstance(msg, Stopped):
            stop = RankStop(msg)
            with self._cv:
                self.stops[stop.key] = stop
            self._send(stop, None, self._sources(msg.missing))
            self._soon_announce(stop)
            return
        key = (msg.mesh, msg.rank, msg.session)
        with self._cv:
            stop = self.stops.get(key)
            if stop is None:
                return
            stop.output.append(msg.output)
            if isinstance(msg, Prompt):
                again = stop.state == "running"  # stopped again at a breakpoint: say so
                stop.state, stop.lineno, stop.filename = "waiting", msg.lineno, msg.filename
            elif isinstance(msg, Resumed):
                again = False
                stop.state = "stepping" if msg.stepping else "running"
            else:  # Ended
                again = False
                stop.state = "ended"
                self.stops.pop(key, None)
                if self.attached == key:
                    self.attached = None
                if stop.output and "".join(stop.output).strip() and not self.serving:
                    self._write(stop.take_output())
            self._cv.notify_all()
        if again:
            self._soon_announce(stop)

    def _soon_announce(self, stop: RankStop) -> None:
        """Say which ranks stopped, once the ones stopping together have arrived."""
        with self._cv:
            self._fresh.append(stop)
            if self._timer is not None:
                return
            self._timer = threading.Timer(ANNOUNCE_WINDOW_S, self.announce)
            self._timer.daemon = True
        self._timer.start()

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
            self._write(self._describe(group) + hint + "\n")

    @staticmethod
    def _sources(files) -> dict:
        """The controller's copy of sources a rank lacks (cells that defined its code)."""
        out = {}
        for name in files:
            lines = linecache.getlines(name)
            if lines:
                out[name] = "".join(lines)
        return out

    def _write(self, text: str) -> None:
        import sys

        def write():
            sys.stdout.write(text)
            sys.stdout.flush()

        ctx = self.session.sink.context
        ctx.run(write) if ctx is not None else write()

    def _send(self, stop: RankStop, line: str | None, sources: dict | None = None) -> None:
        entry = self._mesh(stop.where.mesh)
        port = stop.where.reply
        try:
            if entry is None:
                raise LookupError(f"mesh '{stop.where.mesh}' is no longer attached")
            # Signed with the mesh's key: a detached mesh's ranks know no other.
            Runtime.current().send_port(port.address, port.port_id, Part(0, Status.OK, dumps((line, sources or {}))),
                                        mesh_id=entry[0]._ref.id)
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

    def _mesh(self, name: str):
        return self.session.meshes.get(name) or self.api_meshes.get(name)

    def _alive(self, stop: RankStop) -> bool:
        entry = self._mesh(stop.where.mesh)
        if entry is None:
            return False
        return (entry[0]._ref.id, stop.rank) not in Runtime.current().dead

    # ------------------------------------------------------------ the prompt

    def waiting(self) -> list[RankStop]:
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
                    elif self._controller_prompt(waiting) == "leave" and leave_on_detach:
                        return
                except StdinNotImplementedError:
                    self._write("this frontend cannot send input; continuing the stopped ranks\n")
                    for s in waiting:
                        self._command(s, "c")
        finally:
            self.serving = False
            if not self.stops:
                self.attached, self._chose_detach = None, False

    def _stepping_only(self) -> bool:
        states = [s.state for s in self.stops.values()]
        return bool(states) and "waiting" not in states and any(
            st in ("sent", "stepping", "starting") for st in states)

    @staticmethod
    def _describe(stops: list[RankStop]) -> str:
        s = stops[0]
        who = rank_label([x.rank for x in stops])[1:-1]
        if s.where.reason == "post-mortem":
            return f"{who} stopped after {s.where.error} at {s.place()} (post-mortem)"
        return f"{who} stopped at {s.place()}"

    def _target(self, waiting: list[RankStop], auto_attach: bool) -> RankStop | None:
        by_key = {s.key: s for s in waiting}
        if self.attached in by_key:
            return by_key[self.attached]
        if self.attached is not None and self.attached in self.stops:
            return None  # the attached rank is busy; others wait at the controller prompt
        if auto_attach and len(waiting) == 1 and not self._chose_detach:
            self.attached = waiting[0].key
            return waiting[0]
        return None

    def _rank_prompt(self, stop: RankStop) -> None:
        text = stop.take_output()
        if text:
            self._write(text if text.endswith("\n") else text + "\n")
        line = input(f"(Pdb rank {stop.rank}) ")
        if line.strip() == "detach":
            self.attached, self._chose_detach = None, True
            return
        self._command(stop, line)
        if stop.state != "waiting":  # it ran on (or ended): show what it printed last
            text = stop.take_output()
            if text.strip():
                self._write(text if text.endswith("\n") else text + "\n")

    def _command(self, stop: RankStop, line: str) -> None:
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

    def _controller_prompt(self, waiting: list[RankStop]) -> str | None:
        line = input("(mesh pdb) ").strip()
        cmd, _, rest = line.partition(" ")
        if cmd in ("list", "ls", ""):
            self._write(self.listing() + "\n")
        elif cmd == "attach":
            stop = self._find(rest.strip(), waiting)
            if stop is not None:
                self.attached, self._chose_detach = stop.key, False
        elif cmd == "cast":
            spec, _, pdb_cmd = rest.strip().partition(" ")
            ranks = self._ranks(spec)
            chosen = [s for s in waiting if s.rank in ranks]
            if not chosen or not pdb_cmd:
                self._write("type  cast RANKS CMD  with stopped ranks, e.g.  cast 0-3 p x\n")
            self.cast(chosen, pdb_cmd)
        elif cmd in ("continue", "c", "cont"):
            self.cast(waiting, "c")
        elif cmd in ("detach", "quit", "q"):
            return "leave"
        else:
            self._write(HELP + "\n")
        return None

    def cast(self, stops: list[RankStop], pdb_cmd: str) -> None:
        """Send one command to several stopped ranks at once; print each rank's answer."""
        threads = [threading.Thread(target=self._command, args=(s, pdb_cmd), daemon=True) for s in stops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in stops:
            text = s.take_output().rstrip("\n")
            if text:
                self._write("".join(f"[rank {s.rank}] {ln}\n" for ln in text.splitlines()))

    def _find(self, spec: str, waiting: list[RankStop]) -> RankStop | None:
        try:
            rank = int(spec)
        except ValueError:
            self._write("type  attach R  with a stopped rank's number\n")
            return None
        for s in waiting:
            if s.rank == rank:
                return s
        self._write(f"rank {rank} is not stopped; stopped: {self._stopped_ranks()}\n")
        return None

    @staticmethod
    def _ranks(spec: str) -> set[int]:
        out: set[int] = set()
        for piece in spec.split(","):
            a, dash, b = piece.partition("-")
            try:
                out.update(range(int(a), int(b) + 1) if dash else [int(a)])
            except ValueError:
                return set()
        return out

    def _stopped_ranks(self) -> str:
        return ", ".join(str(s.rank) for s in self.waiting()) or "none"

    def listing(self) -> str:
        waiting = self.waiting()
        if not waiting:
            return "no rank is stopped in pdb"
        rows = [f"  rank {s.rank} ({s.where.mesh}): {s.place()} in {s.where.function}"
                f"{' (post-mortem)' if s.where.reason == 'post-mortem' else ''}" for s in waiting]
        return "stopped in pdb:\n" + "\n".join(rows)

    # ------------------------------------------------------------ %mesh pdb

    def magic(self, args: list[str]) -> None:
        if not args or args == ["list"]:
            print(self.listing())
            return
        cmd, rest = args[0], args[1:]
        if cmd == "--post-mortem":
            if rest not in (["on"], ["off"]):
                raise UsageError("type  %mesh pdb --post-mortem on  or  %mesh pdb --post-mortem off")
            self.post_mortem = rest[0] == "on"
            for mesh in list(self.session.meshes) + list(self.api_meshes):
                self.tell_ranks(mesh)
            print(f"post-mortem pdb {'on: a rank whose %%mesh cell raises stops in pdb' if self.post_mortem else 'off'}")
            return
        waiting = self.waiting()
        if cmd == "attach":
            if len(rest) != 1:
                raise UsageError("type  %mesh pdb attach R  (see  %mesh pdb  for the stopped ranks)")
            stop = next((s for s in waiting if str(s.rank) == rest[0]), None)
            if stop is None:
                raise UsageError(f"rank {rest[0]} is not stopped in pdb; stopped: {self._stopped_ranks()}")
            self.attached, self._chose_detach = stop.key, False
            self.serve(leave_on_detach=True)
        elif cmd == "cast":
            if len(rest) < 2 or not self._ranks(rest[0]):
                raise UsageError("type  %mesh pdb cast RANKS CMD, e.g.  %mesh pdb cast 0-3 p x")
            ranks = self._ranks(rest[0])
            chosen = [s for s in waiting if s.rank in ranks]
            if not chosen:
                raise UsageError(f"none of ranks {rest[0]} is stopped in pdb; stopped: {self._stopped_ranks()}")
            self.cast(chosen, " ".join(rest[1:]))
        elif cmd == "continue":
            if not waiting:
                print("no rank is stopped in pdb")
            self.cast(waiting, "c")
        else:
            raise UsageError("type  %mesh pdb [list | attach R | cast RANKS CMD | continue | --post-mortem on|off]")

    def tell_ranks(self, mesh: str) -> None:
        """Where the mesh's ranks report pdb stops (this kernel), and the post-mortem setting."""
        self._mesh(mesh)[1].debug_setup.broadcast(self.port, self.post_mortem)

    def mesh_spawned(self, procs) -> None:
        """A mesh spawned in a cell (not by ``%mesh spawn``): its ranks' pdb reports here."""
        if self.session.spawning or procs.name in self.session.meshes:
            return
        from .rank_pdb import PdbSetup

        self.api_meshes[procs.name] = (procs, procs.spawn("mesh_pdb", PdbSetup, self.port, self.post_mortem))

    def cell_options(self) -> dict:
        return {"pdb_port": self.port, "post_mortem": self.post_mortem}
