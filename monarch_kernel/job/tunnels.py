"""An out-of-cluster host's ssh connection as its only way to and from the controller.

The agent's ssh process is an ssh ControlMaster (its control socket in the controller's 0700
run directory).  Each TCP port the controller listens on is forwarded (``-R``) to the same
port of the host's loopback, where the agent and its ranks reach it (``controller_via``, set
for them; a port another program holds there is ``PortTaken``, and the controller moves);
each address a process on the host listens on is forwarded (``-L``) to a unix
socket in the run directory, which the controller's transport dials instead.  Curve and the
HMAC still authenticate end to end; the controller opens no port on any network interface.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import subprocess
import threading
from collections.abc import Callable
from types import SimpleNamespace

from ..runtime.hosting import PortTaken

log = logging.getLogger("monarch_kernel.job")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _ip(address: str) -> str:
    return address[len("tcp://"):].rsplit(":", 1)[0]


def port_taken(host: str, port: int | str) -> str:
    """Why a reverse forward of the controller's ``port`` to ``host`` failed, and what to do."""
    return (f"cannot forward this controller's port {port} to {host}: port {port} of {host}'s loopback is in use "
            f"there (another job of this controller that reaches {host} through ssh holds it: use that job, or "
            f"kill it first; or another program on {host} listens on it)")


class Tunnels:
    """One host's forwards, through the control socket ``ctl`` of its agent's ssh."""

    def __init__(self, host: str, rundir: str, tag: str, controller_ip: str, link, ctl: str | None = None):
        """``link``: the host's ``AgentLink``; its ``ip`` (from the agent's UP, before anything is
        sent to the host) is the address its processes listen on.  ``ctl``: another ssh's control
        socket (a Slurm login node's, which connects onward to the node), instead of its own."""
        self.host = host
        self.ctl = ctl or os.path.join(rundir, f"ssh{tag}")
        self._socks = os.path.join(rundir, f"f{tag}-")
        self.controller_ip = controller_ip
        self.link = link
        self._lock = threading.Lock()
        self._local: dict[str, str] = {}  # a host address -> the ipc address that reaches it
        self._remote: set[int] = set()  # controller ports forwarded to the host
        self._ready = False  # the master is up: later ports are added to it
        self._added: list[list[str]] = []  # the forwards added through the master since it was up

    def master_options(self, controller_addresses: list[str]) -> list[str]:
        """ssh's options for the agent's connection: the master, and the controller's ports so far."""
        opts = ["-o", "ControlMaster=yes", "-o", f"ControlPath={self.ctl}", "-o", "ExitOnForwardFailure=yes",
                "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]
        for addr in controller_addresses:
            self._remote.add(_port(addr))
            opts += ["-R", f"127.0.0.1:{_port(addr)}:{_ip(addr)}:{_port(addr)}"]
        return opts

    def environment(self) -> str:
        """Shell assignments for the agent: listen on the address ssh came in on, and reach
        the controller's IP through this host's loopback."""
        via = f" MONARCH_KERNEL_CONTROLLER_VIA={shlex.quote(self.controller_ip)}"
        return 'set -- $SSH_CONNECTION; export MONARCH_KERNEL_BIND="$3"' + via + "; "

    def ready(self, controller_addresses: list[str]) -> None:
        """The agent is up (its ssh is the master): forward the ports opened meanwhile."""
        with self._lock:
            self._ready = True
            late = [a for a in controller_addresses if _port(a) not in self._remote]
            self._remote.update(_port(a) for a in late)
        for addr in late:
            self._forward(["-R", f"127.0.0.1:{_port(addr)}:{_ip(addr)}:{_port(addr)}"])

    def _forward(self, spec: list[str]) -> None:
        r = subprocess.run(["ssh", "-S", self.ctl, "-O", "forward", *spec, self.host], capture_output=True,
                           text=True, timeout=15, stdin=subprocess.DEVNULL)
        if r.returncode != 0 and spec[0] == "-R" and "forwarding failed" in r.stderr.lower():
            raise PortTaken(port_taken(self.host, _port("tcp://" + spec[1])))
        if r.returncode != 0:
            raise ConnectionError(f"cannot forward {' '.join(spec)} through the ssh connection to {self.host}: "
                                  f"{r.stderr.strip() or r.returncode}")
        self._added.append(spec)  # (``dial`` holds the lock here)

    def controller_listens(self, address: str) -> None:
        """A new controller port: forward it to the host's loopback too (once the master is up)."""
        port = _port(address)
        with self._lock:
            if port in self._remote or not self._ready:  # not yet: ``ready`` forwards it
                return
            self._remote.add(port)
        try:
            self._forward(["-R", f"127.0.0.1:{port}:{_ip(address)}:{port}"])
        except ConnectionError:
            with self._lock:
                self._remote.discard(port)  # the controller may listen at this port again later
            raise

    def carries(self, address: str) -> bool:
        """Whether ``address`` is on this host (so this ssh connection carries what goes there)."""
        ip = self.link.ip
        return bool(ip) and address.startswith(f"tcp://{ip}:")

    def cancel(self) -> None:
        """Take back the forwards added to a master that was up already (``join``'s: the
        master outlives this process; it may be gone already)."""
        specs, self._added = self._added, []
        for spec in specs:
            subprocess.run(["ssh", "-S", self.ctl, "-O", "cancel", *spec, self.host], capture_output=True,
                           timeout=15, stdin=subprocess.DEVNULL)

    def dial(self, address: str) -> str | None:
        """The local unix socket that reaches ``address`` on this host, or None if not its."""
        if not self.carries(address):
            return None
        ip = self.link.ip
        with self._lock:
            got = self._local.get(address)
            if got is None:
                path = f"{self._socks}{len(self._local)}"
                self._forward(["-L", f"{path}:{ip}:{_port(address)}"])
                got = self._local[address] = f"ipc://{path}"
                log.debug("reaching %s on %s through %s", address, self.host, path)
        return got


# ---------------------------------------------------------------- another process's masters


def join(rt, routes: dict[str, list[str]]) -> Callable[[], None]:
    """Reach hosts through ssh masters another process of this user holds (a detached mesh's
    host process; ``routes``: each host's address -> [its name, the master's control socket]):
    this process's TCP ports forwarded to each host's loopback, where the ranks reply to it
    (so it listens on 127.0.0.1), and its connections to the hosts' addresses through ``-L``
    forwards to unix sockets in its own run directory.  Returns what cancels them all."""
    tag = secrets.token_hex(3)
    joined = []
    for i, (ip, (host, ctl)) in enumerate(routes.items()):
        t = Tunnels(host, rt.rundir, f"{tag}{i}", "127.0.0.1", SimpleNamespace(ip=ip))
        t.ctl = ctl
        joined.append(t)
    for t in joined:
        t.ready(rt.tcp_addresses())

    def listens(address: str) -> None:
        for t in joined:
            t.controller_listens(address)

    def dial(address: str) -> str | None:
        return next((got for t in joined if (got := t.dial(address))), None)

    unhook = [rt.on_listen(listens), rt.add_dialer(dial)]

    def undo() -> None:
        for remove in unhook:
            remove()
        for t in joined:
            t.cancel()

    return undo
