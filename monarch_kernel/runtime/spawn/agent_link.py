"""Runs in the controller: its link to the agent on one of its hosts, standing in for the
local template (``template_client``) when ranks are forked on that host.

The link speaks ``host_messages`` messages, framed by ``agent_channel``, over the runtime's own signed
(and, between hosts, Curve) messages.  What the agent's template says of its ranks (output,
hellos, heartbeats, exits) arrives as the same messages and goes to the launcher as a local
template's does.  The link beats
every ``BEAT_S`` and declares the agent gone after ``SILENT_S`` of silence (a cut link, a dead
machine), or at once when its launcher says so (the ssh or srun process exited): every rank
it forked then dies with a reason that names the host.

The launcher gives it what it uses: the IO thread, the network (where this process is
reached, its Curve keys), the outbox to send with (``send_or_report``), and what this process
hands its ranks (``Inherited``: the job key, its address, the modules to warm).
"""

from __future__ import annotations

import errno
import secrets
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..completion import Completion
from . import agent_channel as wire
from . import host_messages as hw
from .capacity import NoRoom, Shortfall
from .launch_config import LaunchConfig
from .stack_dump import PendingDumps

if TYPE_CHECKING:
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..wire.envelope import Header
    from .launcher import Inherited


class Sender(Protocol):
    """What the link sends with: the runtime's outbox (``calls/outbox.py``, a room above this
    one, which spawn/ never imports)."""

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool: ...


class AgentLink:
    """``host``: the name the job knows the host by (what deaths and ``%mesh status`` say).
    ``events`` (a ``TemplateEvents``) hears what the agent's template says of its ranks."""

    def __init__(self, *, host: str, events, io: IOThread, network: Network, outbox: Sender, inherited: Inherited):
        self.io, self.network, self.outbox, self.inherited = io, network, outbox, inherited
        self.host = host
        self.id = "h" + secrets.token_hex(5)
        self.events = events
        self.address: str | None = None  # the agent's inbox, from its UP
        self.info: dict = {}  # what the agent said of itself: hostname, pid, ip, python, version
        self.up = Completion()
        self.alive = True
        self.why_gone = ""
        self.last_heard = time.monotonic()
        self._tags = 0
        self._waiting: dict[int, tuple[Callable, Callable | None]] = {}  # tag -> (forked, failed), IO thread
        self._reserving: dict[int, Completion] = {}  # tag -> the ports asked for
        self._handlers: dict[type, Callable] = {
            hw.Output: self._output, hw.Hello: lambda m: self.events.hello(m.pid, m.hello),
            hw.Beats: lambda m: self.events.beats(m.pids), hw.Ports: self._ports, hw.Forked: self._forked,
            hw.ForkFailed: self._fork_failed, hw.Exit: lambda m: self.events.exited(m.pid, m.status),
            hw.Beat: lambda m: None, hw.StackDump: lambda m: self._dumps.arrived(m),
            hw.Usages: lambda m: (self._usage.pop(m.tag, lambda _m: None))(m), hw.HistoryFile: self._history_file,
            hw.Warmed: self._warmed, hw.Drained: lambda m: self._drains.pop(m.tag, lambda: None)()}
        self._drains: dict[int, Callable[[], None]] = {}  # tag -> who hears the Drained, IO thread
        self._usage: dict[int, Callable] = {}  # tag -> who hears the Usages, IO thread
        self._history: dict[int, Callable] = {}  # tag -> who hears the HistoryFiles, IO thread
        self._dumps = PendingDumps()  # IO thread
        # What the agent's warm standby holds, as it last said (``warm``); None: it never
        # answered a ``Warm`` (not asked yet, or an older agent, which is then never sent ``standby``).
        self.standby: list[str] | None = None

    @property
    def ip(self) -> str:
        return self.info.get("ip", "")

    def credentials(self, controller: str, bind: str | None = None) -> bytes:
        """The line to write to the agent's stdin (it holds the job's keys)."""
        assert self.network.curve is not None
        return wire.credentials(self.id, self.inherited.key, self.network.curve, controller, bind,
                                tuple(self.inherited.warm_modules))

    # ------------------------------------------------------------ sending (any thread)

    def _send(self, msg: hw.Message) -> bool:
        if self.address is None or not self.alive:
            return False
        h, body = wire.encode(self.id, self.network.net_address or self.inherited.address, msg)
        return self.outbox.send_or_report(self.address, h, body, f"a {msg.OP} for the agent on {self.host}")

    def _tag(self) -> int:
        self._tags += 1
        return self._tags

    def reserve_async(self, n: int, check: bool = False, rank_memory: int = 0) -> Completion:
        """``n`` free TCP ports on the host for ranks' inboxes: a completion (any thread).  With
        ``check`` the host first sees that it holds ``n`` more ranks, else it fails with ``NoRoom``."""
        got = Completion()

        def ask():
            tag = self._tag()
            self._reserving[tag] = got
            if not self._send(hw.Reserve(tag, n, check, rank_memory)):
                got.set_exception(ConnectionError(f"cannot reach the agent on {self.host}"
                                                  + (f": {self.why_gone}" if self.why_gone else "")))

        self.io.call_soon(ask)
        return got

    def fork(self, config: LaunchConfig, on_forked, on_failed=None, standby: bool = False) -> None:
        """On the IO thread: fork one rank there (its template forwards its output); a
        ``standby`` one (a restarted rank) from the agent's warm standby once it has one."""
        if not self.alive:
            raise OSError(errno.EPIPE, f"the agent on {self.host} is gone")
        tag = self._tag()
        self._waiting[tag] = (on_forked, on_failed)
        self._send(hw.Fork(tag, config.to_wire(), standby and self.standby is not None))

    def warm(self, pids: list[int]) -> list[str]:
        """On the IO thread: have the agent's standby hold the heavy modules rank ``pids[0]``
        (live ranks of one mesh there) imported.  Returns what it held when it last answered
        ([] before); never waits (an older agent never answers)."""
        self._send(hw.Warm(list(pids)))
        return list(self.standby or [])

    def restarts(self) -> StandbyForker:
        """What forks a restarted rank on this host: the agent's warm standby, when ready."""
        return StandbyForker(self)

    def stacks(self, pids: list[int], native: bool, on_dump: Callable[[hw.StackDump], None]) -> None:
        """On the IO thread: py-spy each rank of ``pids`` there (the host's template runs it)."""
        tag = self._tag()
        self._dumps.add(tag, len(pids), on_dump)
        if not self._send(hw.Stacks(tag, list(pids), bool(native))):
            self._dumps.drop(tag)
            why = f"the agent on {self.host} is gone" + (f": {self.why_gone}" if self.why_gone else "")
            for pid in pids:
                on_dump(hw.StackDump(tag, pid, -1, b"", why.encode()))

    def usage(self, pids: list[int], on_usages: Callable[[hw.Usages], None]) -> None:
        """On the IO thread: CPU ticks and memory of ranks there (their agent reads /proc)."""
        tag = self._tag()
        self._usage[tag] = on_usages
        if not self._send(hw.Usage(tag, list(pids))):
            del self._usage[tag]
            on_usages(hw.Usages(tag, []))

    def history(self, mesh: str, have: list[str], on_file: Callable[[hw.HistoryFile], None]) -> None:
        """(IO thread) Ask the agent for its host's history files of ``mesh`` not in ``have``;
        ``on_file`` hears each, then one with ``last`` set (with ``error`` if the agent cannot
        be asked)."""
        tag = self._tag()
        self._history[tag] = on_file
        if not self._send(hw.HistoryAsk(tag, mesh, list(have))):
            del self._history[tag]
            on_file(hw.HistoryFile(tag, self.host, "", b"", True, f"the agent on {self.host} is gone"))

    def drain(self, then: Callable[[], None]) -> None:
        """(IO thread) Ask the agent to send what its ranks have written so far; ``then`` is
        called once all of it has been handed to the events (``output``), or the agent is gone."""
        tag = self._tag()
        self._drains[tag] = then
        if not self._send(hw.Drain(tag)):
            self._drains.pop(tag)()

    def _history_file(self, msg: hw.HistoryFile) -> None:
        on_file = self._history.pop(msg.tag, None) if msg.last else self._history.get(msg.tag)
        if on_file is not None:
            on_file(msg)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        self._send(hw.Kill(pid, int(sig)))

    def close(self) -> None:
        """End the agent and every rank on it (it exits on its own when we do, too)."""
        self._send(hw.Bye())

    # ------------------------------------------------------------ hearing (IO thread)

    def beat(self, now: float) -> None:
        """Every beat: beat, and declare the agent gone once it has been silent too long."""
        if not self.alive or self.address is None:
            return
        if now - self.last_heard > wire.SILENT_S:
            self.gone(f"its agent has been silent for {now - self.last_heard:.1f} s "
                      f"(the host is down or its network link is cut)")
            return
        self._send(hw.Beat())

    def on_message(self, origin: str, msg: hw.Message) -> None:
        self.last_heard = time.monotonic()
        if type(msg) is hw.Up:  # the one message whose origin matters: where the agent listens
            self._up(msg, origin)
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _output(self, msg: hw.Output) -> None:
        for pid, fd, data in msg.items:
            self.events.output(pid, fd, data)

    def _up(self, msg: hw.Up, origin: str) -> None:
        self.address = origin
        self.info = {"hostname": msg.hostname, "pid": msg.pid, "ip": msg.ip, "python": msg.python,
                     "version": msg.version}
        if not self.up.done():
            self.up.set_result(True)

    def _ports(self, msg: hw.Ports) -> None:
        got = self._reserving.pop(msg.tag, None)
        if got is not None and msg.refused:
            got.set_exception(NoRoom(Shortfall(msg.limit, msg.fits, msg.refused), self.host))
        elif got is not None:
            got.set_result(msg.ports)

    def _warmed(self, msg: hw.Warmed) -> None:
        self.standby = list(msg.modules)

    def _forked(self, msg: hw.Forked) -> None:
        cbs = self._waiting.pop(msg.tag, None)
        if cbs is not None:
            cbs[0](msg.pid)

    def _fork_failed(self, msg: hw.ForkFailed) -> None:
        cbs = self._waiting.pop(msg.tag, None)
        if cbs is not None and cbs[1] is not None:
            cbs[1](f"on {self.host}: {msg.error}")

    def gone(self, why: str) -> None:
        """On the IO thread: the agent (and so every rank it forked) is gone; ``why`` says how."""
        if not self.alive:
            return
        self.alive = False
        self.why_gone = why
        self._waiting.clear()  # ranks never forked die below, with the rest (pid None)
        for got in self._reserving.values():
            if not got.done():
                got.set_exception(ConnectionError(f"the agent on {self.host} is gone: {why}"))
        if not self.up.done():
            self.up.set_exception(ConnectionError(f"the agent on {self.host} is gone: {why}"))
        asked, self._history = self._history, {}
        for tag, on_file in asked.items():
            on_file(hw.HistoryFile(tag, self.host, "", b"", True, f"the agent on {self.host} is gone: {why}"))
        drains, self._drains = self._drains, {}
        for then in drains.values():
            then()
        self.events.exited(None, None, why)


class StandbyForker:
    """A link's fork for a restarted rank (``Launcher._forker``): from the agent's standby."""

    def __init__(self, link: AgentLink):
        self.link = link

    def fork(self, config: LaunchConfig, on_forked, on_failed=None) -> None:
        self.link.fork(config, on_forked, on_failed, standby=True)
