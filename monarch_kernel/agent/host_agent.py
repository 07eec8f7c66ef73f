"""The host agent: forks a controller's ranks on this host and reports on them.

Everything it says goes to the controller as ``host_messages`` over the runtime's own
signed, Curve-encrypted link; it holds no state the controller cannot rebuild by starting a
new agent.  Its ranks run in a local template it starts, as ranks on the controller's own
host do, and get this host's interpreter, ``sys.path`` and bind address in their launch config;
restarted ones fork from its warm standby (``warm_standby.py``) once the controller asked for one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable

from ..history.host_side import HostHistory
from ..runtime.hosting import (
    IOThread,
    LaunchConfig,
    Runtime,
    TemplateClient,
    diagnostics,
    host_shortfall,
    loopback_for,
    proc_stats,
    raise_nofile_limit,
    template_files_shortfall,
)
from ..runtime.hosting import agent_channel as wire
from ..runtime.hosting import config as settings
from ..runtime.hosting import host_messages as hw
from . import host_paths
from .warm_standby import WarmStandby


def route_address(controller: str) -> str:
    """The local address of this host's route to ``controller`` (tcp://ip:port): what the
    agent and its ranks bind to, so they listen on no other interface."""
    ip = controller[len("tcp://"):].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class HostAgent:
    def __init__(self, rt: Runtime, host_id: str, controller: str, ip: str, rundir: str, warm: tuple):
        self.rt = rt
        self.host_id = host_id
        self.controller = controller
        self.ip = ip
        self.rundir = rundir
        self.warm = warm
        self.template: TemplateClient | None = None
        self.standby: WarmStandby | None = None  # started with the template
        self.last_heard = time.monotonic()
        self.heard = False  # anything from the controller yet: if not, it is out of reach
        self.pids: set[int] = set()  # ranks forked and not yet exited
        self.ending = False
        self._output: list = []  # output read this turn, forwarded as one message
        self._skipped: dict[str, str] = {}  # the controller's folders not used here, and why (said once)
        self._flushing = False
        self.history = HostHistory()  # its ranks' lines, written into this host's history
        self._handlers: dict[type, Callable] = {
            hw.Fork: lambda m: self._fork(m.tag, m.config, m.standby), hw.Warm: self._warm,
            hw.Reserve: lambda m: self._say(self._reserve(m)), hw.Kill: self._kill, hw.Stacks: self._stacks,
            hw.Usage: lambda m: self._say(hw.Usages(m.tag, proc_stats.usages(
                [p for p in m.pids if p in self.pids]).items)),
            hw.HistoryAsk: lambda m: self.history.ask(m, self._say_soon), hw.Drain: self._drain,
            hw.Bye: lambda m: self.shutdown("the controller ended the job")}

    # ------------------------------------------------------------ on the IO thread

    def start(self) -> None:
        self.template = TemplateClient(self.rt.io.loop, self, self.warm)
        self.standby = WarmStandby(self.rt.io.loop, self, self.warm)
        self._say(hw.Up(socket.gethostname(), os.getpid(), self.ip, sys.executable, _version()))
        self.rt.io.loop.call_later(wire.BEAT_S, self._beat)

    def _say(self, msg: hw.Message) -> None:
        h, body = wire.encode(self.host_id, self.rt.address, msg)
        self.rt.send_or_report(self.controller, h, body, f"a {msg.OP} for the controller")

    def _say_soon(self, msg: hw.Message) -> None:
        """``_say`` from any thread."""
        self.rt.io.call_soon(self._say, msg)

    def _beat(self) -> None:
        silent = time.monotonic() - self.last_heard
        if silent > wire.SILENT_S:
            if not self.heard:  # the job may start this host's agent again through its ssh connection
                print(f"{wire.NEVER_HEARD} {self.controller} in {silent:.1f} s", file=sys.stderr, flush=True)
            self.shutdown(f"the controller has been silent for {silent:.1f} s")
        self._say(hw.Beat())
        self.rt.io.loop.call_later(wire.BEAT_S, self._beat)

    def on_message(self, origin: str, msg: hw.Message) -> None:
        self.last_heard = time.monotonic()
        self.heard = True
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _template_of(self, pid: int) -> TemplateClient | None:
        """The template that forked rank ``pid``: a standby, or the agent's own."""
        return (self.standby.template_of(pid) if self.standby is not None else None) or self.template

    def _kill(self, msg: hw.Kill) -> None:
        template = self._template_of(msg.pid)
        if template is not None and msg.pid in self.pids:
            template.kill(msg.pid, msg.signal)

    def _drain(self, msg: hw.Drain) -> None:
        """Every template sends what its ranks wrote so far; then it goes on, and ``Drained``
        after it (the controller's cell ends once its ranks' output is in)."""
        templates = [t for t in [self.template, *(self.standby.templates() if self.standby else [])]
                     if t is not None and t.alive]
        left = [len(templates)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._flush()
                self._say(hw.Drained(msg.tag))

        if not templates:
            self._say(hw.Drained(msg.tag))
        for template in templates:
            template.drain(lambda: self.rt.io.call_soon(one_done))

    def _warm(self, msg: hw.Warm) -> None:
        """The standby is to hold what a live rank of ``msg.pids`` (one mesh's) imported; the
        answer says what it holds now (the controller asks again while it imports)."""
        pid = next((p for p in msg.pids if p in self.pids), None)
        if self.standby is not None:
            self._say(hw.Warmed(self.standby.held() if pid is None else self.standby.refresh(pid)))

    def _stacks(self, msg: hw.Stacks) -> None:
        """py-spy on ranks of this host, run by their template (their parent); each dump goes
        back as it comes."""
        ours = [p for p in msg.pids if p in self.pids]
        for pid in msg.pids:
            if pid not in self.pids:
                self._say(hw.StackDump(msg.tag, pid, -1, b"", b"not a live rank of this host"))
        by_template: dict[int, tuple[TemplateClient, list[int]]] = {}  # py-spy runs in each rank's parent
        for pid in ours:
            if (template := self._template_of(pid)) is not None:
                by_template.setdefault(id(template), (template, []))[1].append(pid)
        for template, pids in by_template.values():
            template.stacks(pids, msg.native, lambda d: self._say(hw.StackDump(msg.tag, d.pid, d.status, d.out, d.err)))

    def _reserve(self, msg: hw.Reserve) -> hw.Ports:
        """Free ports on the bind address; held open together so they differ, then let go
        for the ranks to bind (each rank's inbox binds its port a moment later).  With
        ``check``, none unless this host holds the ranks (memory, processes, the template's
        open files): the controller then refuses the spawn before anything is forked."""
        if msg.check:
            short = host_shortfall(msg.n, msg.rank_memory) or template_files_shortfall(msg.n, len(self.pids))
            if short is not None:
                return hw.Ports(msg.tag, [], short.why, short.limit, short.fits)
        socks = []
        try:
            for _ in range(msg.n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((self.ip, 0))
                socks.append(s)
            return hw.Ports(msg.tag, [s.getsockname()[1] for s in socks])
        except OSError as e:
            return hw.Ports(msg.tag, [], f"it could not reserve {msg.n:,} ports on {self.ip} for the ranks' "
                                         f"inboxes: {e.strerror} (after {len(socks):,})", "ports", len(socks))
        finally:
            for s in socks:
                s.close()

    def _fork(self, tag: int, config: dict, standby: bool = False) -> None:
        # This host's own interpreter paths first, then the controller's that exist here too (a
        # shared filesystem: the user's project) and are the user's (host_paths); this host's
        # run directory and bind address.
        mine = list(sys.path)
        skipped: dict[str, str] = {}
        theirs = [p for p in config.get("sys_path") or () if p and p not in mine and self._ours(p, skipped)]
        config = dict(config, rundir=self.rundir, sys_path=mine + theirs, cleanup_dirs=[self.rundir],
                      env={**(config.get("env") or {}), settings.env_name("bind_address"): self.ip})
        if not self._ours(config.get("cwd") or "", skipped):
            config["cwd"] = os.getcwd()
        news = {p: why for p, why in skipped.items() if p not in self._skipped}
        self._skipped.update(news)
        assert self.template is not None

        launch = LaunchConfig.from_wire(config)

        def forked(pid: int) -> None:
            self.pids.add(pid)
            ref = launch.mesh
            self.history.forked(pid, ref.name, launch.rank, ref.hosts[launch.rank] if ref.hosts else self.ip,
                                launch.env)
            self._say(hw.Forked(tag, pid))
            if news:  # said once per folder, as what the first rank given it printed
                self.output(pid, 2, _skipped_line(socket.gethostname(), news))

        def failed(why: str) -> None:
            self._say(hw.ForkFailed(tag, why))

        if not (standby and self.standby is not None and self.standby.fork(launch, forked, failed)):
            self.template.fork(launch, forked, failed)

    @staticmethod
    def _ours(path: str, skipped: dict[str, str]) -> bool:
        """Whether the controller's folder ``path`` is here and the user's; if it is here and
        not the user's, why goes in ``skipped``."""
        if not path or not os.path.isdir(path):
            return False
        why = host_paths.why_not_ours(path)
        if why is not None:
            skipped[path] = why
        return why is None

    # ------------------------------------------------------------ what the template says (TemplateEvents)

    def output(self, pid: int, fd: int, data: bytes) -> None:
        self.history.output(pid, fd, data)
        self._output.append([pid, fd, data])
        if not self._flushing:
            self._flushing = True
            self.rt.io.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        items, self._output = self._output, []
        if items:
            self._say(hw.Output(items))

    def hello(self, pid: int, hello: bytes) -> None:
        self._flush()  # what the rank printed first goes first
        self._say(hw.Hello(pid, hello))

    def beats(self, pids: list) -> None:
        self._say(hw.Beats(pids))

    def exited(self, pid: int | None, status: int | None) -> None:
        if pid is None:  # the template is gone: so are the ranks
            self.shutdown("the template exited")
            return
        assert status is not None  # the template reports a rank's exit with its wait status
        self.pids.discard(pid)
        self.history.exited(pid)
        self._flush()
        self._say(hw.Exit(pid, status))

    def shutdown(self, why: str) -> None:
        """End every rank and this process (any thread)."""
        if self.ending:
            return
        self.ending = True
        try:
            print(f"monarch_kernel agent: ending its ranks and exiting: {why}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # its launcher's stream is gone
            pass
        try:
            self.history.flush()  # os._exit below runs no atexit
            if self.standby is not None:
                self.standby.close()
            if self.template is not None:
                self.template.close()
        finally:
            shutil.rmtree(self.rundir, ignore_errors=True)
            os._exit(0)


def _skipped_line(host: str, skipped: dict[str, str]) -> bytes:
    said = "; ".join(f"{p} ({why})" for p, why in skipped.items())
    return (f"monarch_kernel: on {host} the ranks do not use the controller's folders that are not yours "
            f"there (another user could put code in them): {said}.  Make them yours (chown, chmod go-w), or "
            f"sync_env=True\n").encode()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("monarch-kernel")
    except Exception:  # noqa: BLE001  (an uninstalled checkout has no metadata)
        return "unknown"


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line.strip():
        print("monarch_kernel.agent: no credentials on stdin; this is started by a job's launcher "
              "(SSHJob, SlurmJob), not by hand", file=sys.stderr)
        return 2
    creds = wire.read_credentials(line)
    controller = creds["controller"]
    try:
        via = settings.get("controller_via")  # reached through a relay: bind on the route to it
        ip = creds.get("bind") or settings.bind_address() or route_address(
            (loopback_for(via)(controller) if via and "@" in via else None) or controller)
    except OSError as e:
        print(f"{wire.NO_ROUTE} {controller} ({e.strerror})", file=sys.stderr, flush=True)
        return 3
    rundir = tempfile.mkdtemp(prefix="mk-agent-")
    os.chmod(rundir, 0o700)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the user's terminal is the controller's
    raise_nofile_limit()
    diagnostics.install()
    io = IOThread(name="monarch-agent-io")
    rt = Runtime.for_agent(key=creds["key"], rundir=rundir, controller=controller, address=f"tcp://{ip}:*",
                           curve=creds["curve"], io=io)
    agent = HostAgent(rt, creds["host"], controller, ip, rundir, tuple(creds.get("warm") or ()))
    rt.hooks.host.install(agent.on_message)
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown("SIGTERM"))
    io.run(agent.start)
    with contextlib.suppress(OSError):  # a launcher that reads it times reach_timeout from here
        print(wire.DIALING, flush=True)
    while True:  # the launcher's stream: EOF means the controller (or its ssh/srun) is gone
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    io.run(lambda: agent.shutdown("its stdin closed (the controller or its launcher is gone)"))
    return 0
