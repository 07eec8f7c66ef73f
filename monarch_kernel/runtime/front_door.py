"""The front door: what the layers above runtime/ may ask of the runtime's parts, as methods
of ``Runtime`` (trio's ``_core/_generated_run.py`` plays this role for its runner).

Upper layers never name a part (``rt.launcher``, ``rt.caller``, ``rt.outbox``...; tests/system/test_layering.py
checks it), so a part can change behind these methods without them noticing.  Each class here
is the door to one group of parts, mixed into ``Runtime``; each method only delegates.
``rt.io`` and ``rt.hooks`` are surfaces of their own and have no door.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .calls.actor_lives import ActorLives
    from .calls.caller import Caller
    from .calls.outbox import Outbox
    from .calls.supervision import SupervisionPolicy
    from .completion import Completion
    from .context import MeshRef
    from .net.io_thread import IOThread
    from .net.network import Network
    from .net.transport import Transport
    from .spawn.agent_link import AgentLink
    from .spawn.host_links import HostLinks
    from .spawn.launcher import Launcher
    from .spawn.owned_mesh import OwnedMesh
    from .wire.curve import CurveKeys
    from .wire.envelope import Header, Part


class MeshDoor:
    """Meshes and hosts: the launcher, the host links, and the meshes this process spawned."""

    launcher: Launcher
    host_links: HostLinks
    meshes: dict

    def spawn_mesh(self, name: str, dims: tuple, env: dict | None = None, *, bootstrap: bytes | None = None,
                   python: str | None = None, hosts: list | None = None, check: bool = False) -> OwnedMesh:
        """Launch a mesh's ranks (``Launcher.spawn`` says how)."""
        return self.launcher.spawn(name, dims, env, bootstrap=bootstrap, python=python, hosts=hosts, check=check)

    def start_templates(self, n: int, python: str | None = None) -> None:
        """Start, without waiting, the local templates ``n`` more ranks of ``python`` will
        fork from (``Launcher.start_templates``): a spawn's setup then overlaps their start."""
        self.launcher.start_templates(n, python)

    @property
    def per_template(self) -> int:
        """How many ranks one template forks: the room check counts in these."""
        return self.launcher.per_template

    def kill_ranks(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """SIGKILL ``ranks`` of a mesh this process spawned; one completion per rank, done once
        its death is handled."""
        return self.launcher.kill(om, ranks)

    def restart_ranks(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """Start dead ``ranks`` again in place; one completion per rank, done when it connected."""
        return self.launcher.restart(om, ranks)

    def warm_standby(self, om: OwnedMesh) -> list[str]:
        """Keep a template holding the heavy modules ``om``'s ranks imported, for its replaced
        ranks to fork from (``Launcher.warm_standby``); the modules it holds."""
        return self.launcher.warm_standby(om)

    def stop_mesh(self, om: OwnedMesh) -> Completion:
        """End every rank of ``om``; the completion is done once they have all exited."""
        return self.launcher.stop(om)

    def drain_output(self, timeout: float) -> bool:
        """Wait until what this process's ranks have written so far has reached the output
        hooks (``Launcher.drain_output``); False if that took more than ``timeout`` s."""
        return self.launcher.drain_output(timeout)

    def add_host(self, host: str) -> AgentLink:
        """A link for the agent a job is about to start on ``host`` (``HostLinks.add_host``)."""
        return self.host_links.add_host(host)

    def end_host(self, link: AgentLink, bye: bool = True) -> None:
        """End a host on purpose: its ranks stop, which is no failure (``HostLinks.end_host``)."""
        self.host_links.end_host(link, bye)

    def forget_host(self, link: AgentLink, why: str) -> None:
        """Drop an agent that ended before it connected (its job starts it again another way)."""
        self.host_links.forget_host(link, why)

    def owned_mesh(self, mesh_id: str) -> OwnedMesh | None:
        """The mesh ``mesh_id`` if this process spawned it (its processes, deaths, stops)."""
        return self.meshes.get(mesh_id)

    def owned_meshes(self) -> list[OwnedMesh]:
        """Every mesh this process spawned and has not forgotten, as of now."""
        return list(self.meshes.values())


class CallDoor:
    """Calls, ports and hosted actors: the caller, the outbox, the actors' lives and supervision."""

    caller: Caller
    outbox: Outbox
    actor_lives: ActorLives
    supervision: SupervisionPolicy
    io: IOThread

    def tell(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list, slice_info) -> None:
        """A call nobody waits for and nobody answers (``Caller.tell``)."""
        self.caller.tell(mesh, actor, method, ranks, body, slice_info)

    def interrupt_ranks(self, mesh: MeshRef, ranks, actor: str = "", wait: float = 0.0) -> bool:
        """KeyboardInterrupt in ``actor`` (or every actor) on ``ranks``; ``wait``: seconds to
        wait until each rank delivered it (True if all did)."""
        return self.caller.interrupt(mesh, ranks, actor, wait=wait)

    def calls_waiting_on(self, mesh_id: str) -> dict[int, int]:
        """How many of this process's calls each rank of ``mesh_id`` still owes an answer
        (``busy_ranks`` says only which)."""
        return self.caller.busy_ranks(mesh_id)

    def calls_pending_on(self, mesh_id: str) -> list[tuple[int, str, str, frozenset[int]]]:
        """This process's calls that ranks of ``mesh_id`` still owe answers to, oldest first:
        (call id, actor, method, the ranks still waited on) (``Caller.pending_on``)."""
        return self.caller.pending_on(mesh_id)

    def send_port(self, address: str, port_id: int, part: Part, mesh_id: str | None = None) -> None:
        """Deliver one value to a port opened by the process at ``address``; ``mesh_id``: a mesh
        that process belongs to, whose key signs the message (default: our own)."""
        self.outbox.send_port(address, port_id, part, mesh_id)

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool:
        """Send a message nobody waits on; a failure is logged once per peer (no caller to
        raise it to).  False if it was not sent."""
        return self.outbox.send_or_report(address, h, body, what)

    def abort_actor(self, actor_id: str, reason: str) -> None:
        """The hosted actor ``actor_id`` fails with ``reason`` (``ActorLives.abort``)."""
        self.actor_lives.abort(actor_id, reason)

    def interrupt_actor(self, actor_id: str) -> bool:
        """KeyboardInterrupt in hosted actor ``actor_id``'s running sync endpoint, from any
        thread (the IO thread may be held by a debugger); False if it runs none."""
        return self.actor_lives.interrupt(actor_id)

    def actors_serving(self) -> bool:
        """Whether an actor hosted in this process runs a sync endpoint now: ranks that called it
        wait on this process, not on each other (the hang watchdog counts it as progress)."""
        return self.actor_lives.serving()

    def actor_instance(self, actor_id: str):
        """The object behind an actor hosted in this process (None if there is none)."""
        return self.actor_lives.instance(actor_id)

    def note_spawned(self, owner: str, ref: MeshRef, actor_id: str, ranks: list[int]) -> None:
        """Hosted actor ``owner`` spawned actor mesh ``actor_id`` on ``ranks`` of ``ref``: it
        stops when ``owner`` does."""
        self.actor_lives.note_spawned(owner, ref, actor_id, ranks)

    def note_hosted(self, mesh_id: str, spawner, class_name: str, actor_id: str, ranks) -> None:
        """An actor mesh was spawned on ``ranks`` of mesh ``mesh_id``, which this process owns:
        a death there is reported as that actor's failure (``SupervisionPolicy.note_hosted``)."""
        self.supervision.note_hosted(mesh_id, spawner, class_name, actor_id, ranks)

    def forget_deaths(self, mesh_id: str, ranks) -> None:
        """Forget that ``ranks`` of ``mesh_id`` died (they were started again, here or by the
        mesh's owner).  Any thread: it runs on the IO thread, and returns once it has."""
        self.io.run(self.supervision.forget_deaths, mesh_id, list(ranks))


class NetDoor:
    """Where this process listens and how it reaches its peers: the network and the transport."""

    network: Network
    transport: Transport
    address: str

    @property
    def net_address(self) -> str | None:
        """The main inbox's TCP address, once this process listens for other hosts."""
        return self.network.net_address

    def listen(self, ip: str, keys: CurveKeys | None = None) -> str:
        """Listen for processes on other hosts on ``ip`` too, with the job's Curve ``keys``
        (made here unless given); returns the main inbox's TCP address (``Network.listen``)."""
        return self.network.listen(ip, keys)

    def tcp_addresses(self) -> list[str]:
        """The TCP addresses this process listens on so far."""
        return self.network.tcp_addresses()

    def on_listen(self, hook: Callable[[str], None]) -> Callable[[], None]:
        """``hook(address)`` hears each TCP address this process starts listening on, before
        anyone is given it (an ssh forward is set up there).  A hook whose far end cannot have
        that port raises ``PortTaken``: the process listens at another, and every hook hears it.
        Returns its remover."""
        return self.network.add_listen_hook(hook)

    @property
    def curve_keys(self) -> CurveKeys | None:
        """The Curve keys this process's TCP inboxes serve with (None before any are made)."""
        return self.network.curve

    def use_job_keys(self, keys: CurveKeys) -> None:
        """Take another job's Curve keys as this process's own (attaching to a detached mesh
        on a job's hosts); only before it listens for hosts of its own."""
        self.network.use_job_keys(keys)

    def add_dialer(self, dial: Callable[[str], str | None],
                   carrier: Callable[[str], str | None] | None = None) -> Callable[[], None]:
        """``dial(addr)``: where to connect to reach the peer at ``addr`` (an ssh forward's
        end), or None for ``addr`` itself (``Transport.add_dialer``).  Returns its remover."""
        return self.transport.add_dialer(dial, carrier)

    def route(self, addr: str) -> str:
        """Where to connect to reach the peer at ``addr``: for the data plane's own sockets,
        which must go where this process's messages go."""
        return self.transport.route(addr)

    def forget_peer(self, address: str) -> None:
        """Close every thread's sockets to the process at ``address`` (a port's address too):
        it is gone, and a new one may come at the same address."""
        self.transport.forget(self.network.reach(self.address, address))
