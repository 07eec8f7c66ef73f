"""The host agent: forks a controller's ranks on this host and reports on them.

Everything it says goes to the controller as ``agent_wire`` messages over the runtime's own
signed, Curve-encrypted link; it holds no state the controller cannot rebuild by starting a
new agent.  Its ranks run in a local template it starts, as ranks on the controller's own
host do, and get this host's interpreter, ``sys.path`` and bind address in their launch config.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from ..runtime import agent_wire as wire
from ..runtime.io_thread import IOThread
from ..runtime.launch import LaunchConfig
from ..runtime.process import Runtime
from ..runtime.template_client import TemplateClient

READ_SIZE = 1 << 16


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
        self.last_heard = time.monotonic()
        self.pipes: dict[int, list[int]] = {}  # tag -> [stdout_r, stderr_r]
        self.tag_of: dict[int, int] = {}  # pid -> tag
        self.ending = False

    # ------------------------------------------------------------ on the IO thread

    def start(self) -> None:
        self.template = TemplateClient(self.rt.io.loop, self._on_exit, self.warm)
        self._say({"op": wire.UP, "hostname": socket.gethostname(), "pid": os.getpid(), "ip": self.ip,
                   "python": sys.executable, "version": _version()})
        self.rt.io.loop.call_later(wire.BEAT_S, self._beat)

    def _say(self, msg: dict) -> None:
        h, body = wire.encode(self.host_id, self.rt.address, msg)
        self.rt.send_or_report(self.controller, h, body, f"a {msg['op']} for the controller")

    def _beat(self) -> None:
        silent = time.monotonic() - self.last_heard
        if silent > wire.SILENT_S:
            self.shutdown(f"the controller has been silent for {silent:.1f} s")
        self._say({"op": wire.BEAT})
        self.rt.io.loop.call_later(wire.BEAT_S, self._beat)

    def on_message(self, origin: str, msg: dict) -> None:
        self.last_heard = time.monotonic()
        op = msg["op"]
        if op == wire.FORK:
            self._fork(msg["tag"], msg["config"])
        elif op == wire.RESERVE:
            self._say({"op": wire.PORTS, "tag": msg["tag"], "ports": self._reserve(int(msg["n"]))})
        elif op == wire.KILL:
            if self.template is not None and msg.get("pid") in self.tag_of:
                self.template.kill(int(msg["pid"]), int(msg.get("signal", signal.SIGKILL)))
        elif op == wire.BYE:
            self.shutdown("the controller ended the job")

    def _reserve(self, n: int) -> list[int]:
        """Free ports on the bind address; held open together so they differ, then let go
        for the ranks to bind (each rank's inbox binds its port a moment later)."""
        socks = []
        try:
            for _ in range(max(0, min(n, 4096))):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((self.ip, 0))
                socks.append(s)
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()

    def _fork(self, tag: int, config: dict) -> None:
        # This host's own interpreter paths first, then the controller's that exist here too (a
        # shared filesystem: the user's project); this host's run directory and bind address.
        mine = list(sys.path)
        theirs = [p for p in config.get("sys_path") or () if p and p not in mine and os.path.isdir(p)]
        config = dict(config, rundir=self.rundir, sys_path=mine + theirs, cleanup_dirs=[self.rundir],
                      env=dict(config.get("env") or {}, MONARCH_KERNEL_BIND=self.ip))
        if not os.path.isdir(config.get("cwd") or ""):
            config["cwd"] = os.getcwd()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.pipes[tag] = [out_r, err_r]
        loop = self.rt.io.loop
        for fd, n in ((out_r, 1), (err_r, 2)):
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._readable, tag, fd, n)
        assert self.template is not None

        def forked(pid: int) -> None:
            self.tag_of[pid] = tag
            self._say({"op": wire.FORKED, "tag": tag, "pid": pid})

        try:
            self.template.fork(LaunchConfig.from_wire(config), out_w, err_w, forked)
        finally:
            os.close(out_w)
            os.close(err_w)

    def _readable(self, tag: int, fd: int, n: int) -> bool:
        """Forward what the rank wrote; False once its end is closed."""
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.rt.io.loop.remove_reader(fd)
            os.close(fd)
            fds = self.pipes.get(tag)
            if fds is not None and fd in fds:
                fds[fds.index(fd)] = -1
            return False
        self._say({"op": wire.OUTPUT, "tag": tag, "fd": n, "data": data})
        return True

    def _on_exit(self, pid: int | None, status: int | None) -> None:
        if pid is None:  # the template is gone: so are the ranks
            self.shutdown("the template exited")
            return
        tag = self.tag_of.pop(pid, -1)
        for i, fd in enumerate(self.pipes.pop(tag, [])):
            if fd >= 0:
                while self._readable(tag, fd, i + 1):  # all it wrote before it exited
                    pass
        self._say({"op": wire.EXIT, "tag": tag, "pid": pid, "status": status})

    def shutdown(self, why: str) -> None:
        """End every rank and this process (any thread)."""
        if self.ending:
            return
        self.ending = True
        try:
            if self.template is not None:
                self.template.close()
        finally:
            shutil.rmtree(self.rundir, ignore_errors=True)
            os._exit(0)


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
    ip = creds.get("bind") or os.environ.get("MONARCH_KERNEL_BIND") or route_address(controller)
    rundir = tempfile.mkdtemp(prefix="mk-agent-")
    os.chmod(rundir, 0o700)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the user's terminal is the controller's
    io = IOThread(name="monarch-agent-io")
    rt = Runtime(creds["key"], rundir, "agent", io, owner=controller, address=f"tcp://{ip}:*",
                 curve=creds["curve"])
    agent = HostAgent(rt, creds["host"], controller, ip, rundir, tuple(creds.get("warm") or ()))
    rt.hooks.host.install(agent.on_message)
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown("SIGTERM"))
    io.run(agent.start)
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
