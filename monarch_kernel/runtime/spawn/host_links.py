"""The links to the agents of this process's hosts: adding one for an agent a job is about
to start, the heartbeat that finds a silent one, ports reserved on each for a mesh's ranks,
ending a host on purpose, and routing what an agent says to its link.

It owns the links (``links``, by link id); what an agent's template says of its ranks goes
to the rank events (``rank_events.py``), as a local template's does.  It forks nothing itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import config
from . import agent_channel
from .agent_link import AgentLink, Sender

if TYPE_CHECKING:
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from .launcher import Inherited
    from .owned_mesh import OwnedMesh
    from .rank_events import RankEvents


class HostLinks:
    """Its public methods may be called from any thread (they hand their work to the IO
    thread); ``on_host`` and the beat run on it."""

    def __init__(self, *, io: IOThread, network: Network, outbox: Sender, meshes: dict[str, OwnedMesh],
                 events: RankEvents, inherited: Inherited):
        """``meshes``: the meshes this process spawned (a host ended on purpose marks its
        ranks' meshes stopping); ``inherited``: what each agent is handed."""
        self.io, self.network, self.outbox, self.meshes = io, network, outbox, meshes
        self.events, self.inherited = events, inherited
        self.links: dict[str, AgentLink] = {}  # agents of this process's hosts, by link id
        self._beating = False

    def add_host(self, host: str) -> AgentLink:
        """A link for the agent a job is about to start on ``host``; its ``credentials()`` go
        to the agent's stdin, and ``up`` completes when it has connected."""
        link = AgentLink(host=host, events=None, io=self.io, network=self.network, outbox=self.outbox,
                         inherited=self.inherited)
        link.events = self.events.of(link.id)
        self.links[link.id] = link
        if not self._beating:
            self._beating = True
            self.io.call_soon(self._beat)
        return link

    def reserve(self, hosts: list[AgentLink], per: int, check: bool) -> dict[str, list[int]]:
        """Ports for ``per`` ranks on each host, asked of every agent at once (each sees
        first that it has room, with ``check``)."""
        cost = config.rank_memory()
        asked = {link.id: link.reserve_async(per, check, cost) for link in {link.id: link for link in hosts}.values()}
        deadline = time.monotonic() + config.spawn_timeout()
        ports = {}
        for link in hosts:
            got = asked[link.id]
            if not got.wait(max(0.0, deadline - time.monotonic())):
                raise ConnectionError(f"the agent on {link.host} did not answer within {config.spawn_timeout():g} s")
            if (err := got.error()) is not None:
                raise err
            ports[link.id] = list(got.result())
        return ports

    def end_host(self, link: AgentLink, bye: bool = True) -> None:
        """End a host on purpose (``job.kill()``): the ranks there stop, which is no failure.
        ``bye=False``: only mark them so, for an agent that its job ends another way (an
        attached worker, told over its own connection)."""
        def go():
            for om in list(self.meshes.values()):
                if om.links is not None and any(lk is link for lk in om.links):
                    om.stopping = True
            if bye:
                link.close()

        self.io.run(go)

    def forget_host(self, link: AgentLink, why: str) -> None:
        """Drop an agent ended before it connected (its job starts it again another way)."""
        self.io.run(lambda: link.gone(why))
        self.links.pop(link.id, None)  # after: the IO thread heard it, and never hears it again

    def on_host(self, origin: str, host_id: str, msg) -> None:
        """A ``host_messages`` message from the agent of host ``host_id``."""
        link = self.links.get(host_id)
        if link is not None and link.alive:
            link.on_message(origin, msg)

    def _beat(self) -> None:
        now = time.monotonic()
        for link in list(self.links.values()):
            link.beat(now)
        self.io.loop.call_later(agent_channel.BEAT_S, self._beat)

    def close(self) -> None:
        """At exit: every host's agent is told to end."""
        for link in list(self.links.values()):
            link.close()
