"""``SSHJob``: any hosts reachable by ``ssh``; each runs an agent started as the ssh command.

Host names are ssh's: a ``Host`` alias, ``-F FILE`` and ``-J``/``ProxyJump`` work as for ssh
itself (``ssh_config``).  ssh runs with ``BatchMode=yes`` (the agent's stdin carries its credentials, so a password
prompt could never be answered) and the user's ``ssh_args``.  The agent dies with the ssh
session, and the session with this controller.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

from ..actor.host_mesh import HostMesh
from ..runtime.hosting import Runtime, config
from ..runtime.hosting import hosts as host_names
from .agents import AGENT_MODULE, AgentProcess, controller_address
from .env_sync import HostEnv, sync_hosts
from .job import JobTrait
from .ssh_config import route_host
from .tunnels import Tunnels


class UnreachableControllerWarning(UserWarning):
    """An ``SSHJob``'s hosts could not connect to this controller, so their connections go
    through the ssh connections that start their agents (``out_of_cluster``).

    Example::

        import warnings
        warnings.simplefilter("error", UnreachableControllerWarning)   # refuse the tunnel instead
    """


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_level() -> int:
    """The stacklevel, seen from the caller of this, of the first frame outside this package:
    the user's ``job.state()`` or ``spawn_procs``."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


class SSHJob(JobTrait):
    """Hosts reached over SSH: ``add_mesh(name, hosts)`` names a group of hosts, and ``state()``
    starts an agent on each and returns their host meshes.

    Example::

        job = SSHJob(python_exe="/opt/venv/bin/python", ssh_args=("-i", "~/.ssh/id_ed25519"))
        job.add_mesh("workers", ["node1", "node2"])
        procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
        job.kill()
    """

    kind = "ssh"

    def __init__(self, python_exe: str = "python3", ssh_args=(), monarch_port: int | None = None,
                 start_timeout: float | None = None, out_of_cluster: bool | None = None,
                 sync_env: bool | str = False):
        """``out_of_cluster=True``: no host can open a connection to this controller (a laptop
        beyond a login node); every connection between them goes through the ssh connection
        that started the host's agent (``tunnels``), and this controller listens on loopback only.
        ``None`` (the default): a host whose agent has not connected within ``reach_timeout``
        is started again that way, said once (``UnreachableControllerWarning``).  ``False``: never.
        ``sync_env``: first send this controller's Python environment to hosts that lack it
        (a folder: the hosts' cache there, instead of ~/.cache/monarch-kernel/env)."""
        super().__init__()
        if out_of_cluster is not None and not isinstance(out_of_cluster, bool):
            raise TypeError(f"out_of_cluster is True, False or None (try direct, then through ssh), "
                            f"not {out_of_cluster!r}")
        if isinstance(ssh_args, str):
            raise TypeError("ssh_args is a sequence of arguments, e.g. ('-i', '~/.ssh/id_ed25519'), not one string")
        self.python_exe = python_exe
        self.ssh_args = tuple(ssh_args)
        self.start_timeout = start_timeout
        self.sync_env = sync_env
        self.env_syncs: dict[str, HostEnv] = {}  # host -> what sync_env did there
        self._meshes: dict[str, list[str]] = {}
        self._agents: dict[str, AgentProcess] = {}  # host -> its agent
        self.out_of_cluster = out_of_cluster
        self._tunnels: dict[str, Tunnels] = {}  # host -> its forwards (out of cluster)
        self._unhook: list = []

    def add_mesh(self, name: str, hosts) -> SSHJob:
        """A host mesh called ``name`` over ``hosts`` (names or addresses ssh can reach)."""
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(",") if h]
        if not isinstance(hosts, (list, tuple)):
            raise TypeError(f"add_mesh({name!r}, hosts): hosts is a list of names ssh reaches, e.g. "
                            f"add_mesh({name!r}, ['node1', 'me@node2']); not {type(hosts).__name__}")
        hosts = list(hosts)
        for h in hosts:
            host_names.check_name(h.rpartition("@")[2] if isinstance(h, str) else h, f"add_mesh({name!r}, ...): a host",
                       f"add_mesh({name!r}, ['node1', 'me@node2'])")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh names are attributes of job.state(): {name!r} is not an identifier")
        if not hosts:
            raise ValueError(f"mesh {name!r} needs at least one host")
        if self._running:
            raise RuntimeError("add meshes before the job is applied (job.state()); kill() it to change them")
        self._meshes[name] = hosts
        return self

    @property
    def hosts(self) -> list[str]:
        seen: dict[str, None] = {}
        for hosts in self._meshes.values():
            seen.update(dict.fromkeys(hosts))
        return list(seen)

    def _ssh(self, host: str) -> list[str]:
        return ["ssh", "-o", "BatchMode=yes", *self.ssh_args, host, "--"]

    def command(self, host: str, tunnels: Tunnels | None = None, controller: Sequence[str] = ()) -> list[str]:
        """The agent's ssh command; it says its pid first, so a stuck one can be ended.  With
        ``tunnels`` it is also their ssh master, forwarding the ``controller``'s addresses; on
        a host ``sync_env`` synced, it runs that environment's python."""
        synced = self.env_syncs.get(host)
        python = synced.python if synced else self.python_exe
        path = f"PYTHONPATH={shlex.quote(synced.pythonpath)} " if synced and synced.pythonpath else ""
        run = f"{path}exec {shlex.quote(python)} -m {AGENT_MODULE}"
        if tunnels is None:
            return [*self._ssh(host), f"echo mk-agent-pid $$; {run}"]
        return ["ssh", "-o", "BatchMode=yes", *tunnels.master_options(list(controller)), *self.ssh_args, host, "--",
                f"echo mk-agent-pid $$; {tunnels.environment()}{run}"]

    def _remote(self, host: str, argv: list[str]) -> list[str]:
        return [*self._ssh(host), shlex.join(argv)]

    def _remote_kill(self, host: str):
        def kill(pid: int) -> None:
            subprocess.run([*self._ssh(host), f"kill -KILL {int(pid)}"], timeout=10, capture_output=True)
        return kill

    def _create(self) -> None:
        if not self._meshes:
            raise ValueError("this job has no hosts: job.add_mesh('workers', ['host1', 'host2']) first")
        rt = Runtime.current()
        if self.sync_env:
            cache = self.sync_env if isinstance(self.sync_env, str) else None
            self.env_syncs = sync_hosts(self.hosts, self._remote, self.python_exe, cache)
        deadline = time.monotonic() + (self.start_timeout or config.spawn_timeout())
        started: dict[str, AgentProcess] = {}
        try:
            if self.out_of_cluster:
                started = self._start_out_of_cluster(rt, self.hosts)
            else:
                controller = controller_address(rt, route_host(self.hosts[0], self.ssh_args))
                started = {h: AgentProcess(rt, h, self.command(h), controller, remote_kill=self._remote_kill(h))
                           for h in self.hosts}
                if self.out_of_cluster is None:
                    self._tunnel_unreached(rt, started, controller, deadline)
            for agent in started.values():
                agent.wait_up(deadline, self.python_exe)
            for tunnels in self._tunnels.values():
                tunnels.ready(rt.tcp_addresses())
        except BaseException:
            for agent in started.values():
                agent.kill()
            self._unhook_tunnels()
            raise
        self._agents = started

    def _tunnel_unreached(self, rt: Runtime, started: dict[str, AgentProcess], controller: str,
                          deadline: float) -> None:
        """Hosts whose agents have not connected within ``reach_timeout`` of dialing: end those agents and
        forget their links, then start them again through their ssh connections."""
        far = [h for h, agent in started.items() if not agent.reached(config.reach_timeout(), deadline)]
        if not far or time.monotonic() >= deadline:  # no time left for another start: wait_up says why
            return
        ended = [started.pop(h) for h in far]
        with ThreadPoolExecutor(len(ended)) as pool:  # each may end its agent over ssh
            list(pool.map(AgentProcess.kill, ended))
        for agent in ended:
            rt.forget_host(agent.link, "ended: its host could not reach the controller")
        warnings.warn(
            f"the agent on {', '.join(far)} could not reach this controller ({controller}) within "
            f"{config.reach_timeout():g} s: this job's connections to {'it' if len(far) == 1 else 'them'} go through "
            "the ssh connection that starts each agent instead (out_of_cluster).  SSHJob(..., out_of_cluster=True) "
            "starts that way at once; out_of_cluster=False never does (MONARCH_KERNEL_REACH_TIMEOUT sets the wait)",
            UnreachableControllerWarning, stacklevel=_caller_level())
        started.update(self._start_out_of_cluster(rt, far))

    def _start_out_of_cluster(self, rt: Runtime, hosts: list[str]) -> dict[str, AgentProcess]:
        """Agents whose ssh connections carry every connection to and from their hosts."""
        controller = rt.listen("127.0.0.1")  # no network port, unless one is open
        tag = secrets.token_hex(3)
        links = {h: rt.add_host(h) for h in hosts}
        self._tunnels = {h: Tunnels(h, rt.rundir, f"{tag}{i}", controller[len("tcp://"):].rsplit(":", 1)[0], links[h])
                         for i, h in enumerate(hosts)}
        self._unhook = [rt.on_listen(self._controller_listens),
                        rt.add_dialer(self._dial, self._carrier)]
        addresses = rt.tcp_addresses()
        return {h: AgentProcess(rt, h, self.command(h, self._tunnels[h], addresses), controller,
                                remote_kill=self._remote_kill(h), link=links[h]) for h in hosts}

    def _controller_listens(self, address: str) -> None:
        for tunnels in self._tunnels.values():
            tunnels.controller_listens(address)

    def _dial(self, address: str) -> str | None:
        for tunnels in self._tunnels.values():
            got = tunnels.dial(address)
            if got:
                return got
        return None

    def _carrier(self, address: str) -> str | None:
        """The host whose ssh connection carries ``address``: a call to its ranks is sent
        there once and fanned out on the host (``Caller.subtrees``)."""
        for host, tunnels in self._tunnels.items():
            if tunnels.carries(address):
                return host
        return None

    def _unhook_tunnels(self) -> None:
        for undo in self._unhook:
            undo()
        self._unhook = []
        self._tunnels = {}

    def control_socket(self, host: str) -> str | None:
        """The control socket of the ssh connection that carries ``host``'s traffic when it is
        out of cluster (``ssh -S PATH -O forward -L ...`` adds a forward of one's own through
        it), or None when the host is reached directly."""
        tunnels = self._tunnels.get(host)
        return tunnels.ctl if tunnels else None

    def routes(self) -> dict[str, list[str]]:
        """Each out-of-cluster host's address -> [its name, its control socket]: what another
        process of this user needs to reach this job's hosts too (``tunnels.join``)."""
        return {t.link.ip: [h, t.ctl] for h, t in self._tunnels.items() if t.link.ip}

    def _host_meshes(self) -> dict[str, HostMesh]:
        return {name: HostMesh(agents=[self._agents[h].link for h in hosts]) for name, hosts in self._meshes.items()}

    def _kill(self) -> None:
        for agent in self._agents.values():
            agent.kill()
        self._agents = {}
        self._unhook_tunnels()

    def _spec(self) -> dict:
        return {"python_exe": self.python_exe, "ssh_args": list(self.ssh_args), "meshes": self._meshes,
                "out_of_cluster": self.out_of_cluster, "sync_env": self.sync_env}

    @classmethod
    def _from_spec(cls, spec: dict) -> SSHJob:
        job = cls(python_exe=spec["python_exe"], ssh_args=tuple(spec.get("ssh_args") or ()),
                  out_of_cluster=spec.get("out_of_cluster"), sync_env=spec.get("sync_env", False))
        for name, hosts in spec["meshes"].items():
            job.add_mesh(name, hosts)
        return job
