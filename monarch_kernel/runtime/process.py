"""The runtime of one process, composed of parts that each own their state: the network
(where it listens, Curve), the transport (sending), the receiver (inboxes and waits), the
outbox (every message it sends), the caller (calls in flight), the gathering (calls passing
through), the server (serving calls), the actors' lives, the supervision policy, the
launcher (meshes it spawned), and the ports.  One table maps each message kind to the part
that handles it.

The parts are built from the leaves up, each given what it uses at construction; one named
constructor per process (``for_controller``, ``for_rank``, ``for_agent``) says how that
process's runtime differs.  A host's agent builds only the parts it uses.  It knows nothing
of Jupyter or of the public classes: it moves encoded parts, and the actor layer turns them
into values and exceptions.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from . import config, diagnostics
from .calls import finalize
from .calls.actor_lives import ActorLives
from .calls.answers import Answers
from .calls.caller import Caller
from .calls.gathering import Gathering
from .calls.outbox import Outbox
from .calls.server import Server
from .calls.supervision import SupervisionPolicy, unhandled
from .completion import Completion
from .context import MeshRef, process_mesh
from .failure import DeathInfo, MeshFailure
from .front_door import CallDoor, MeshDoor, NetDoor
from .hooks import Hooks
from .limits import open_files_limit, raise_nofile_limit
from .local_door import LocalDoor
from .net import unfinished
from .net.inbox import Inbox
from .net.io_thread import IOThread
from .net.network import Network
from .net.ports import PortTable
from .net.receiver import Receiver
from .net.transport import Transport
from .spawn import agent_channel, stack_dump
from .spawn.host_links import HostLinks
from .spawn.launcher import Inherited, Launcher
from .spawn.rank_events import RankEvents
from .wire import rejects, segments
from .wire.auth import DropCounts, Signer
from .wire.curve import CurveKeys
from .wire.envelope import Header, Kind, split_parts

if TYPE_CHECKING:
    from .calls.main_thread import MainThread
    from .calls.outstanding import PendingCall
    from .spawn.launch_config import LaunchConfig
    from .spawn.owned_mesh import OwnedMesh

log = logging.getLogger("monarch_kernel.runtime")


class Runtime(MeshDoor, CallDoor, NetDoor, LocalDoor):
    _current: Runtime | None = None
    _create_lock = threading.Lock()

    # ------------------------------------------------------------ creation

    @classmethod
    def current(cls) -> Runtime:
        rt = cls._current
        if rt is None:
            with cls._create_lock:
                if cls._current is None:
                    cls._current = cls.for_controller()
                rt = cls._current
        return rt

    @classmethod
    def existing(cls) -> Runtime | None:
        """This process's runtime if one was made (never makes one)."""
        return cls._current

    def job_name(self, label: str, root: str) -> str:
        """A name that every process of the job holding this key computes alike from ``label``
        and ``root`` (the job's root address), and nobody else can: a folder named so in a
        shared /tmp cannot be made first by another user."""
        return hmac.new(self.key, f"{label}\0{root}".encode(), hashlib.sha256).hexdigest()[:32]

    # ------------------------------------------------------------ one constructor per process

    @classmethod
    def for_controller(cls) -> Runtime:
        """The root controller's runtime (``Runtime.current()`` makes it on first use): a
        fresh job key and run directory, which it removes at exit."""
        diagnostics.install()
        raise_nofile_limit()
        rundir = tempfile.mkdtemp(prefix="mk-")
        os.chmod(rundir, 0o700)
        # Curve keys from the start: ranks inherit them, so any of them can reach a TCP peer
        # later (a job's hosts); nothing listens on TCP until the network part listens.
        rt = cls(key=secrets.token_bytes(32), rundir=rundir, name=f"c{os.getpid()}", io=IOThread(), owner=None,
                 curve=CurveKeys.generate(), owns_rundir=True)
        atexit.register(rt.shutdown)
        return rt

    @classmethod
    def for_rank(cls, cfg: LaunchConfig, main_thread: MainThread) -> Runtime:
        """A rank's runtime, from its launch config: a member of its mesh, lending
        ``main_thread`` to one actor, and this process's runtime from now on."""
        ref, rank = cfg.mesh, cfg.rank
        rt = cls(key=cfg.key, rundir=cfg.rundir, name=f"{ref.id}.{rank}", io=IOThread(name="monarch-io"),
                 owner=cfg.owner, address=cfg.address, curve=cfg.curve, member_of=(ref, rank),
                 main_thread=main_thread, python=cfg.python, fanout=cfg.fanout, job_ports=cfg.job_ports)
        cls._current = rt
        process_mesh[0], process_mesh[1] = ref, rank
        for old, new in cfg.forwards.items():  # ranks moved to other hosts before this one started
            rt.transport.forward(old, new)
        return rt

    @classmethod
    def for_agent(cls, *, key: bytes, rundir: str, controller: str, address: str, curve: CurveKeys | None,
                  io: IOThread) -> Runtime:
        """A host's agent's runtime: it only talks to its controller (``controller``): it has
        no caller, server, actors, supervision or launcher."""
        return cls(key=key, rundir=rundir, name="agent", io=io, owner=controller, address=address, curve=curve,
                   serves_actors=False)

    def __init__(self, *, key: bytes, rundir: str, name: str, io: IOThread, owner: str | None,
                 address: str | None = None, curve: CurveKeys | None = None, serves_actors: bool = True,
                 member_of: tuple[MeshRef, int] | None = None, main_thread: MainThread | None = None,
                 python: str | None = None, fanout: int | None = None, job_ports: dict | None = None,
                 owns_rundir: bool = False):
        """Built from the leaves up; use ``for_controller``, ``for_rank`` or ``for_agent``.
        ``address``: where the main inbox listens (default ``ipc://rundir/name``; a TCP address makes
        every inbox of this process TCP, served with ``curve``); ``serves_actors``: whether it makes and serves
        calls and spawns meshes (not a host's agent); ``member_of``: (mesh, rank) for a rank."""
        self.key = key
        self.rundir = rundir
        self.owns_rundir = owns_rundir
        self.host = socket.gethostname()
        self.io = io
        self.owner = owner  # the process that supervises this one (None: the root)
        self.serves_actors = serves_actors
        self.ctx = zmq.Context()
        # ZeroMQ's own cap (1,023 sockets a context) would bind before the open-files limit does.
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, min(open_files_limit(), 65535)))
        # The leaves: they need nothing of the runtime.
        self.drops = DropCounts()
        self.hooks = Hooks()  # how upper layers plug in (hooks.py); nothing is installed here
        self.ports = PortTable()
        self.signer = Signer(key, max_frame=config.max_frame())
        self.segments = segments.Segments() if segments.available() else None
        # The tables, each made here once and handed to whoever reads or fills it.
        self.memberships: dict[str, tuple[MeshRef, int]] = {}  # mesh id -> (mesh, my rank)
        self.meshes: dict[str, OwnedMesh] = {}  # mesh id -> OwnedMesh, for meshes this process spawned
        self.warm_modules: list[str] = []  # what the template imports before forking (warm())
        # Ports every process of the job reaches by name: (address, port id) (publish_port; inherited)
        self.job_ports: dict[str, tuple[str, int]] = dict(job_ports or {})
        # The dispatch table: every kind this process accepts, and the part that handles it;
        # read by the receiver at each message, filled below once the parts exist.
        self.handlers: dict[int, Callable[[Header, list], None]] = {}
        self.main_thread = main_thread  # a rank's (it lends it to one actor); None in the controller
        # Moving messages.
        self.transport = Transport(self.ctx, self.signer, io=io, curve=curve)
        self.network = Network(self.ctx, io, self.drops, curve, vouched=self.signer.vouched,
                               on_keys=self.transport.use_keys)
        self.inbox = self.network.main_inbox(address or f"ipc://{rundir}/{name}")
        self.address = self.inbox.address
        self.receiver = Receiver(io=io, signer=self.signer, drops=self.drops, hooks=self.hooks,
                                 handlers=self.handlers)
        self.outbox = Outbox(io=io, transport=self.transport, network=self.network, inbox=self.inbox,
                             ports=self.ports, memberships=self.memberships, fanout=fanout or config.fanout())
        self.handlers.update(_every_process_kinds(self))
        if serves_actors:
            self._build_serving(member_of, python)
        self.self_mesh = MeshRef(f"p{secrets.token_hex(4)}", "this_proc", (), (self.address,), self.address,
                                 (self.host,))
        self.memberships[self.self_mesh.id] = (self.self_mesh, 0)
        if member_of is not None:
            self.memberships[member_of[0].id] = member_of
        if process_mesh[0] is None:
            process_mesh[0], process_mesh[1] = self.self_mesh, 0
        self.closed = False
        self._exiting = False
        io.call_soon(self.receiver.watch, self.inbox)

    def _build_serving(self, member_of: tuple[MeshRef, int] | None, python: str | None) -> None:
        """The parts of a process that makes and serves calls and spawns meshes (all but a
        host's agent, which only talks to its controller)."""
        io = self.io
        # Calls made here, and the calls this process serves as a node of their tree.
        self.caller = Caller(outbox=self.outbox, io=io, network=self.network, receiver=self.receiver,
                             signer=self.signer, ports=self.ports, segments=self.segments,
                             report_failure=self.report_failure)
        self.gathering = Gathering(outbox=self.outbox, drops=self.drops, memberships=self.memberships)
        answers = Answers(outbox=self.outbox, gathering=self.gathering, signer=self.signer,
                          memberships=self.memberships, report_failure=self.report_failure)
        self.actor_lives = ActorLives(answers=answers, caller=self.caller, receiver=self.receiver,
                                      network=self.network, io=io, host=self.host, main_thread=self.main_thread,
                                      meshes=self.meshes, stop_mesh=self.stop_mesh,
                                      report_failure=self.report_failure)
        self.server = Server(outbox=self.outbox, gathering=self.gathering, answers=answers, lives=self.actor_lives,
                             memberships=self.memberships, network=self.network, address=self.address,
                             drops=self.drops, ports=self.ports, hooks=self.hooks)
        # what a death or a failure means, and who hears it
        self.supervision = SupervisionPolicy(io=io, outbox=self.outbox, caller=self.caller, lives=self.actor_lives,
                                             meshes=self.meshes, memberships=self.memberships, hooks=self.hooks,
                                             owner=self.owner, shutting_down=lambda: self.closed)
        # templates, hosts, forks, restarts, kills
        inherited = Inherited(self.key, self.rundir, self.address, self.host, self.warm_modules, self.job_ports,
                              self.segments, owns_rundir=self.owns_rundir)
        self.rank_events = RankEvents(meshes=self.meshes, supervision=self.supervision, receiver=self.receiver,
                                      inbox=self.inbox, drops=self.drops)
        self.host_links = HostLinks(io=io, network=self.network, outbox=self.outbox, meshes=self.meshes,
                                    events=self.rank_events, inherited=inherited)
        self.launcher = Launcher(io=io, network=self.network, outbox=self.outbox, meshes=self.meshes,
                                 hooks=self.hooks, supervision=self.supervision, events=self.rank_events,
                                 hosts=self.host_links, inherited=inherited, python=python)
        self.handlers.update(_serving_kinds(self))

    # ------------------------------------------------------------ the dispatch table

    def dispatch(self, h: Header, body: list) -> None:
        """Hand one authentic message to its kind's handler (an unknown kind is counted); the
        receiver reads the same table."""
        self.receiver.dispatch_safely(h, body)

    def _on_port(self, h: Header, body: list) -> None:
        parts = split_parts(h, body)
        if parts and not self.ports.deliver(h.call_id, parts[0]):
            self.drops.count("malformed")

    def _on_death(self, h: Header, body: list) -> None:
        self.outbox.pass_down(h, body)
        info = split_parts(h, body)[0].load()
        # h.mesh: the mesh it was sent down; the payload: the dead rank's own mesh
        self.supervision.rank_died(h.payload.mesh if h.payload is not None else h.mesh, info.rank, info)

    def _on_revive(self, h: Header, body: list) -> None:
        self.outbox.pass_down(h, body)
        if h.payload is not None:
            self.caller.revived(h.payload.mesh, h.payload.rank)

    def _on_moved(self, h: Header, body: list) -> None:
        self.outbox.pass_down(h, body)
        if h.payload is not None:
            self.supervision.on_moved([h.payload])

    def _on_stop(self, h: Header, body: list) -> None:
        self.outbox.pass_down(h, body)
        if not self._exiting:
            self._exiting = True
            finalize.exit_process(list(self.actor_lives.actors.values()))

    def _on_failure(self, h: Header, body: list) -> None:
        self.supervision.on_failure_report(h.mesh, split_parts(h, body)[0].load())

    def _on_host(self, h: Header, body: list) -> None:
        msg = agent_channel.decode(h, body)
        if msg is None:
            self.drops.count("malformed")
        elif (agent := self.hooks.host.current()) is not None:  # this process is a host's agent
            agent(h.origin, msg)
        elif self.serves_actors:
            self.host_links.on_host(h.origin, h.mesh, msg)

    # ------------------------------------------------------------ deaths and supervision

    def rank_died(self, mesh_id: str, rank: int, info: DeathInfo) -> int:
        """On the IO thread: fail this process's calls to the rank (``SupervisionPolicy.rank_died``)."""
        return self.supervision.rank_died(mesh_id, rank, info)

    def report_failure(self, mesh_id: str, failure: MeshFailure) -> None:
        """An unobserved failure on a mesh: give it to the mesh's supervisor."""
        if mesh_id in self.meshes:
            self.io.call_soon(self.supervision.supervise, self.meshes[mesh_id], failure)
        elif mesh_id in self.memberships and self.memberships[mesh_id][0].owner != self.address:
            self.outbox.send_object(self.memberships[mesh_id][0].owner, Kind.FAILURE, mesh_id, failure)
        else:
            unhandled(self.hooks, failure)

    def report_failure_to(self, owner, failure: MeshFailure) -> None:
        """A failure of an actor mesh this process spawned: to the actor that spawned it
        (``owner``, an ActorContext; None for this process itself), on the IO thread."""
        self.io.call_soon(self.supervision.supervise_by, owner, failure)

    # ------------------------------------------------------------ what upper layers may ask

    def call(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list, **kw) -> PendingCall:
        """Send a call to ``ranks`` of ``mesh``: see ``Caller.call``."""
        return self.caller.call(mesh, actor, method, ranks, body, **kw)

    def wait(self, completion: Completion, timeout: float | None, inbox: Inbox | None = None) -> bool:
        """Block until ``completion`` is done: see ``Receiver.wait``."""
        return self.receiver.wait(completion, timeout, inbox)

    def death(self, mesh_id: str, rank: int) -> DeathInfo | None:
        """How ``rank`` of mesh ``mesh_id`` died, if this process knows it did."""
        return self.caller.dead.get((mesh_id, rank))

    def any_dead(self) -> bool:
        """Whether this process knows of any dead rank at all (``death`` says which)."""
        return bool(self.caller.dead)

    def busy_ranks(self, mesh_id: str) -> set[int]:
        """Ranks of ``mesh_id`` that calls made from this process still wait on."""
        return set(self.caller.busy_ranks(mesh_id))

    def trust(self, mesh_ids, key: bytes) -> None:
        """Accept (and sign for) meshes of another job whose key is ``key`` (a detached mesh)."""
        self.signer.add_key(list(mesh_ids), key)

    def publish_port(self, name: str, handler) -> tuple[str, int]:
        """Open a port every process of this job can send to, as ``job_ports[name]``; the
        meshes this process spawns from now on inherit it.  Published once per name."""
        if name not in self.job_ports:
            self.job_ports[name] = (self.address, self.ports.open(handler, once=False))
        return self.job_ports[name]

    def warm(self, modules) -> None:
        """Have the template import ``modules`` before it forks ranks (upper layers name the
        classes ranks will unpickle, so that each rank starts with them loaded)."""
        for name in modules:
            if name not in self.warm_modules:
                self.warm_modules.append(name)

    @property
    def port_address(self) -> str:
        """Where the ports this process opens are reached (``Network.port_address``)."""
        return self.network.port_address(self.address)

    def stats(self) -> dict:
        d = self.drops
        return {
            "sent": self.transport.sent,
            "received": self.receiver.received,
            "dropped": {"unsigned": d.unsigned, "forged": d.forged, "truncated": d.truncated,
                        "oversized": d.oversized, "malformed": d.malformed, "curve": d.curve},
            # Every wire's rejections in this process (rejects.py), "wire/reason": count.
            "rejected": {f"{w}/{r}": n for (w, r), n in sorted(rejects.snapshot().items())},
            # What this process holds of same-host messages whose last piece has not come (unfinished.py).
            "unfinished": unfinished.held(),
        }

    def shutdown(self) -> None:
        """End every mesh this process spawned; called at exit."""
        if self.closed:
            return
        self.closed = True
        if self.serves_actors:
            self.launcher.close()
        if self.segments is not None:
            self.segments.close()
        if self.owns_rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)


def _nothing(_h: Header, _body: list) -> None:
    """WAKE: an answer arrived another way; reading the message was the point."""


def _by_hop(at_origin: Callable[[Header, list], None], in_tree: Callable[[Header, list], None]):
    """A REPLY's handler: the caller's for the origin's own answers (hop 0), the tree
    node's for its children's (hop 1); each owns the state the answer changes."""
    def on_reply(h: Header, body: list) -> None:
        if h.hop == 0:
            at_origin(h, body)
        else:
            in_tree(h, body)
    return on_reply


def _every_process_kinds(rt: Runtime) -> dict[int, Callable[[Header, list], None]]:
    """The kinds every process handles, a host's agent too: ports, wake-ups, hosts."""
    return {
        Kind.PORT: rt._on_port,
        Kind.WAKE: _nothing,
        Kind.HOST: rt._on_host,
    }


def _serving_kinds(rt: Runtime) -> dict[int, Callable[[Header, list], None]]:
    """The kinds a process that makes and serves calls handles too."""
    return {
        Kind.NOT_RECEIVED: rt.caller.on_not_received,
        Kind.CALL: rt.server.on_call,
        Kind.SPAWN: rt.server.on_call,
        # A REPLY at hop 0 answers a call made here; at hop 1, one this rank forwarded.
        Kind.REPLY: _by_hop(rt.caller.on_reply, rt.gathering.on_reply),
        Kind.REDIRECT: rt.gathering.on_redirect,
        Kind.PRUNE: rt.gathering.on_prune,
        Kind.INTERRUPT: rt.server.on_interrupt,
        Kind.STACKS: lambda h, body: stack_dump.on_stacks(rt, h, body),
        Kind.DEATH: rt._on_death,
        Kind.REVIVE: rt._on_revive,
        Kind.MOVED: rt._on_moved,
        Kind.STOP: rt._on_stop,
        Kind.FAILURE: rt._on_failure,
    }
