"""``SSHJob``: any hosts reachable by ``ssh``; each runs an agent started as the ssh command.

Host names are ssh's: a ``Host`` alias, ``-F FILE`` and ``-J``/``ProxyJump`` work as for ssh
itself (``ssh_config``).  ssh runs with ``BatchMode=yes`` (the agent's stdin carries its credentials, so a password
prompt could never be answered) and the user's ``ssh_args``.  The agent dies with the ssh
session, and the session with this controller.
"""

from __future__ import annotations

import secrets
import shlex
import subprocess
import time
from collections.abc import Sequence

from ..actor.host_mesh import HostMesh
from ..runtime import config
from ..runtime.process import Runtime
from .agents import AGENT_MODULE, AgentProcess, controller_address
from .env_sync import HostEnv, sync_hosts
from .job import JobTrait
from .ssh_config import route_host
from .tunnels import Tunnels


class SSHJob(JobTrait):
    kind = "ssh"

    def __init__(self, python_exe: str = "python3", ssh_args=(), monarch_port: int | None = None,
                 start_timeout: float | None = None, out_of_cluster: bool = False, sync_env: bool | str = False):
        """``out_of_cluster=True``: no host can open a connection to this controller (a laptop
        beyond a login node); every connection between them goes through the ssh connection
        that started the host's agent (``tunnels``), and this controller listens on loopback only.
        ``sync_env``: first send this controller's Python environment to hosts that lack it
        (a folder: the hosts' cache there, instead of ~/.cache/monarch-kernel/env)."""
        super().__init__()
        if not isinstance(out_of_cluster, bool):
            raise TypeError(f"out_of_cluster is True or False, not {out_of_cluster!r}")
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
        hosts = list(hosts)
        if not name.isidentifier():
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
        if self.out_of_cluster:
            started = self._start_out_of_cluster(rt)
        else:
            controller = controller_address(rt, route_host(self.hosts[0], self.ssh_args))
            started = {h: AgentProcess(rt, h, self.command(h), controller, remote_kill=self._remote_kill(h))
                       for h in self.hosts}
        deadline = time.monotonic() + (self.start_timeout or config.spawn_timeout())
        try:
            for agent in started.values():
                agent.wait_up(deadline, self.python_exe)
            for tunnels in self._tunnels.values():
                tunnels.ready(rt.network.tcp_addresses())
        except BaseException:
            for agent in started.values():
                agent.kill()
            self._unhook_tunnels()
            raise
        self._agents = started

    def _start_out_of_cluster(self, rt: Runtime) -> dict[str, AgentProcess]:
        """Agents whose ssh connections carry every connection to and from their hosts."""
        controller = rt.network.net_address or rt.network.listen("127.0.0.1")  # no network port, unless one is open
        tag = secrets.token_hex(3)
        links = {h: rt.launcher.add_host(h) for h in self.hosts}
        self._tunnels = {h: Tunnels(h, rt.rundir, f"{tag}{i}", controller[len("tcp://"):].rsplit(":", 1)[0], links[h])
                         for i, h in enumerate(self.hosts)}
        self._unhook = [rt.network.add_listen_hook(self._controller_listens), rt.transport.add_dialer(self._dial)]
        addresses = rt.network.tcp_addresses()
        return {h: AgentProcess(rt, h, self.command(h, self._tunnels[h], addresses), controller,
                                remote_kill=self._remote_kill(h), link=links[h]) for h in self.hosts}

    def _controller_listens(self, address: str) -> None:
        for tunnels in self._tunnels.values():
            tunnels.controller_listens(address)

    def _dial(self, address: str) -> str | None:
        for tunnels in self._tunnels.values():
            got = tunnels.dial(address)
            if got:
                return got
        return None

    def _unhook_tunnels(self) -> None:
        for undo in self._unhook:
            undo()
        self._unhook = []
        self._tunnels = {}

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
                  out_of_cluster=bool(spec.get("out_of_cluster")), sync_env=spec.get("sync_env", False))
        for name, hosts in spec["meshes"].items():
            job.add_mesh(name, hosts)
        return job
