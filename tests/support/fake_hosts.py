"""Hosts' agents without processes, for tests that build the launcher alone: ``Hosting``
builds the spawn room's parts (rank events, host links, launcher) over ``fake_net.Parts``,
and ``FakeAgent`` answers a host link as the real agent (``agent/host_agent.py``) does.
Tested in tests/runtime/test_fake_net.py.
"""

from __future__ import annotations

import itertools
import threading
import time

from monarch_kernel.runtime.spawn import agent_channel
from monarch_kernel.runtime.spawn import host_messages as hw
from monarch_kernel.runtime.spawn.host_links import HostLinks
from monarch_kernel.runtime.spawn.host_messages import RankHello
from monarch_kernel.runtime.spawn.launch_config import LaunchConfig
from monarch_kernel.runtime.spawn.launcher import Inherited, Launcher
from monarch_kernel.runtime.spawn.rank_events import RankEvents
from support.fake_net import KEY, Parts


class FakeAgent:
    """The agent of one host, with no process: it answers its link's host messages as the
    real one does (``agent/host_agent.py``): ports reserved from 7000 up, each fork a made-up
    pid that says hello at once, a kill answered by the rank's exit (killed by that signal).
    ``pump()`` (on the IO thread) answers what was sent to it since the last pump."""

    def __init__(self, hosting: Hosting, host: str, ip: str):
        self.hosting, self.ip = hosting, ip
        self.link = hosting.host_links.add_host(host)
        self.address = f"tcp://{ip}:6000"
        self.pids = itertools.count(100 * (1 + len(hosting.agents)))
        self.forked: dict[int, LaunchConfig] = {}  # pid -> what it was forked with
        self.byes = 0
        hosting.agents.append(self)
        self.tell(hw.Up(host, 4242, ip, "python3", "test"))

    def tell(self, msg: hw.Message) -> None:
        """The agent says ``msg`` to its controller (a HOST message, routed by the host links)."""
        self.hosting.parts.io.run(self.hosting.host_links.on_host, self.address, self.link.id, msg)

    def pump(self) -> None:
        for sent in self.hosting.parts.transport.take_to(self.address):
            msg = agent_channel.decode(sent.header, sent.body)
            if isinstance(msg, hw.Reserve):
                self.tell(hw.Ports(msg.tag, list(range(7000, 7000 + msg.n))))
            elif isinstance(msg, hw.Fork):
                cfg, pid = LaunchConfig.from_wire(msg.config), next(self.pids)
                self.forked[pid] = cfg
                self.tell(hw.Forked(msg.tag, pid))
                self.tell(hw.Hello(pid, RankHello(cfg.mesh.id, cfg.rank, pid).encode()))
            elif isinstance(msg, hw.Kill):
                self.tell(hw.Exit(msg.pid, msg.signal))  # a wait status: killed by that signal
            elif isinstance(msg, hw.Bye):
                self.byes += 1


class Hosting:
    """``Parts`` plus the spawn room's parts, built as the runtime builds them: the rank
    events, the host links and the launcher; ``agents`` are fake agents of its hosts, which
    a thread of its own (the IO thread) answers while it runs (``with Hosting() as h``)."""

    def __init__(self):
        p = self.parts = Parts(address="ipc://ctl")
        p.network.net_address = "tcp://10.0.0.9:5555"  # where agents reach the controller
        inherited = Inherited(KEY, "/nonexistent-rundir", p.inbox.address, "ctl-host", [], {}, None,
                              owns_rundir=False)
        self.rank_events = RankEvents(meshes=p.meshes, supervision=p.supervision, receiver=p.receiver,
                                      inbox=p.inbox, drops=p.drops)
        self.host_links = HostLinks(io=p.io, network=p.network, outbox=p.outbox, meshes=p.meshes,
                                    events=self.rank_events, inherited=inherited)
        self.launcher = Launcher(io=p.io, network=p.network, outbox=p.outbox, meshes=p.meshes, hooks=p.hooks,
                                 supervision=p.supervision, events=self.rank_events, hosts=self.host_links,
                                 inherited=inherited)
        self.agents: list[FakeAgent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-io", daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            ran = self.parts.io.turn()
            for agent in list(self.agents):
                self.parts.io.run(agent.pump)
            if not ran:
                time.sleep(0.002)

    def __enter__(self) -> Hosting:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.parts.close()
