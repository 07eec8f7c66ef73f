"""The runtime of one process: inbox, IO thread, calls in flight, hosted actors, and the
meshes it spawned.  The controller and every rank run the same class; a rank is simply a
process whose runtime was created from its launch config.

It knows nothing of Jupyter or of the public classes: it moves encoded parts, and the actor
layer turns them into values and exceptions.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import zmq

from . import agent_wire, config, finalize, serialize, shm
from .actors import ActorSlot
from .auth import DropCounts, Signer
from .calling import Calling
from .calls import PendingCall
from .context import MeshRef, process_mesh
from .curve import CurveKeys, Gatekeeper
from .envelope import Header, Kind, Part, Status, split_parts
from .failure import DeathInfo, MeshFailure
from .hooks import Hooks
from .inbox import Inbox
from .io_thread import IOThread
from .launcher import Launcher
from .limits import open_files_limit, raise_nofile_limit
from .ports import PortTable
from .receiving import Receiving
from .serialize import dumps
from .serving import Serving
from .supervision import SupervisionPolicy
from .transport import Transport
from .tree import NodeTable

if TYPE_CHECKING:
    from .main_thread import MainThread


class Runtime(Receiving, Calling, Serving):
    _current: Runtime | None = None
    _create_lock = threading.Lock()

    # ------------------------------------------------------------ creation

    @classmethod
    def current(cls) -> Runtime:
        rt = cls._current
        if rt is None:
            with cls._create_lock:
                if cls._current is None:
                    cls._current = cls._new_controller()
                rt = cls._current
        return rt

    @classmethod
    def _new_controller(cls) -> Runtime:
        raise_nofile_limit()
        rundir = tempfile.mkdtemp(prefix="mk-")
        os.chmod(rundir, 0o700)
        # Curve keys from the start: ranks inherit them, so any of them can reach a TCP peer
        # later (a job's hosts); nothing listens on TCP until listen_network().
        rt = cls(secrets.token_bytes(32), rundir, f"c{os.getpid()}", IOThread(), owner=None,
                 curve=CurveKeys.generate())
        rt._owns_rundir = True
        atexit.register(rt.shutdown)
        return rt

    def __init__(self, key: bytes, rundir: str, name: str, io: IOThread, owner: str | None,
                 address: str | None = None, curve: CurveKeys | None = None):
        """``address``: where the main inbox listens (default ``ipc://rundir/name``); a TCP
        address makes every inbox of this process TCP, served with ``curve``."""
        self.key = key
        self.rundir = rundir
        self._owns_rundir = False
        self.host = socket.gethostname()
        self.ctx = zmq.Context()
        # ZeroMQ's own cap (1,023 sockets a context) would bind before the open-files limit does.
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, min(open_files_limit(), 65535)))
        self.signer = Signer(key, max_frame=config.max_frame())
        self.transport = Transport(self.ctx, self.signer)
        self.transport.io_thread = io.thread
        self.curve: CurveKeys | None = None
        self.gatekeeper: Gatekeeper | None = None
        self.bind_ip: str | None = None  # set once this process has TCP inboxes
        self.curve = self.transport.curve = curve
        tcp = bool(address and address.startswith("tcp://"))
        if tcp:
            assert curve is not None, "a TCP inbox needs the job's Curve keys"
            self._guard(io)
        self.inbox = Inbox(self.ctx, address or f"ipc://{rundir}/{name}", self.curve)
        if tcp:
            self.bind_ip = self.inbox.address[len("tcp://"):].rsplit(":", 1)[0]
        self.transport.inbox = self.inbox.sock  # the main inbox, for tools that poke at it
        self.address = self.inbox.address
        self._local = threading.local()
        self._thread_inboxes = itertools.count()
        self._free_inboxes: list[Inbox] = []  # reply inboxes of threads that ended, for reuse
        self._free_lock = threading.Lock()
        self._unsent_reported: set[str] = set()
        self.io = io
        self.owner = owner  # the process that supervises this one (None: the root)
        self.fanout = config.fanout()
        self.drops = DropCounts()
        self.calls: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)
        self.nodes = NodeTable()
        self.ports = PortTable()
        self.actors: dict[str, ActorSlot] = {}
        self.memberships: dict[str, tuple[MeshRef, int]] = {}  # mesh id -> (mesh, my rank)
        self.meshes: dict = {}  # mesh id -> OwnedMesh, for meshes this process spawned
        self.dead: dict[tuple[str, int], DeathInfo] = {}
        self.direct: dict[tuple[str, int, str], str] = {}  # (mesh, rank, actor) -> that actor's own TCP inbox
        self.hooks = Hooks()  # how upper layers plug in (hooks.py); nothing is installed here
        self.warm_modules: list[str] = []  # what the template imports before forking (warm())
        # Ports every process of the job can reach, by name: (address, port id).  The root
        # opens them (publish_port); each rank inherits them through its launch config.
        self.job_ports: dict[str, tuple[str, int]] = {}
        self.main_thread: MainThread | None = None  # a MainThread when this is a rank (it lends it to one actor)
        self.segments = shm.Segments() if shm.available() else None
        if serialize.segments is None:
            serialize.segments = self.segments
        self.launcher = Launcher(self)  # templates, hosts, forks, restarts, kills
        self.supervision = SupervisionPolicy(self)  # what a death or a failure means, and who hears it
        self.self_mesh = MeshRef(f"p{secrets.token_hex(4)}", "this_proc", (), (self.address,), self.address,
                                 (self.host,))
        self.memberships[self.self_mesh.id] = (self.self_mesh, 0)
        if process_mesh[0] is None:
            process_mesh[0], process_mesh[1] = self.self_mesh, 0
        self._closed = False
        self._exiting = False
        io.call_soon(self.watch, self.inbox)

    def _dispatch(self, h: Header, body: list) -> None:
        k = h.kind
        if k == Kind.REPLY:
            self._on_reply(h, body)
        elif k == Kind.CALL or k == Kind.SPAWN:
            self._on_call(h, body)
        elif k == Kind.REDIRECT:
            self._on_redirect(h)
        elif k == Kind.PRUNE:
            st = self.nodes.prune((h.origin, h.call_id), h.extra)
            if st is not None:
                self._send_reply(st, h.origin, h.call_id, h.ranks[0])
        elif k == Kind.NOT_RECEIVED:
            call = self.calls.get(h.call_id)
            if call is not None and h.ranks:
                call.not_received(h.ranks[0])
        elif k == Kind.DEATH:
            self.pass_down(h, body)
            info = split_parts(h, body)[0].load()
            # h.mesh: the mesh it was sent down; extra: the dead rank's own mesh
            self.rank_died(h.extra if isinstance(h.extra, str) else h.mesh, info.rank, info)
        elif k == Kind.FAILURE:
            failure = split_parts(h, body)[0].load()
            self.supervision.on_failure_report(h.mesh, failure)
        elif k == Kind.STOP:
            self.pass_down(h, body)
            self._stop_process()
        elif k == Kind.WAKE:
            pass
        elif k == Kind.HOST:
            msg = agent_wire.decode(h, body)
            if msg is None:
                self.drops.count("malformed")
            elif (agent := self.hooks.host.current()) is not None:  # this process is a host's agent
                agent(h.origin, msg)
            else:
                self.launcher.on_host(h.origin, h.mesh, msg)
        elif k == Kind.REVIVE:
            self.pass_down(h, body)
            mesh_id, rank = h.extra
            self.dead.pop((mesh_id, rank), None)
        elif k == Kind.INTERRUPT:
            for actor_id, slot in list(self.actors.items()):
                if not h.actor or actor_id == h.actor:
                    slot.interrupt()
            if h.extra:  # the caller waits until it has landed
                member = self.memberships.get(h.mesh)
                me = member[1] if member else -1
                self.send_port(h.extra[0], h.extra[1], Part(me, Status.OK, dumps(None)), mesh_id=h.mesh)
        elif k == Kind.PORT:
            parts = split_parts(h, body)
            if parts and not self.ports.deliver(h.call_id, parts[0]):
                self.drops.count("malformed")
        else:
            self.drops.count("malformed")

    # ------------------------------------------------------------ deaths and supervision

    def rank_died(self, mesh_id: str, rank: int, info: DeathInfo) -> int:
        """On the IO thread: fail this process's calls to the rank and repair their trees.

        Returns how many calls were waiting on it (and so now hold a ``ProcessDied``).
        """
        if (mesh_id, rank) in self.dead:
            return 0
        self.dead[(mesh_id, rank)] = info
        ref = self.meshes[mesh_id].ref if mesh_id in self.meshes else self.memberships.get(mesh_id, (None,))[0]
        if ref is not None and 0 <= rank < len(ref.addresses):
            self.transport.forget(ref.addresses[rank])  # every thread drops its sockets to it
            for key in [k for k in self.direct if k[0] == mesh_id and k[1] == rank]:
                self.transport.forget(self.direct.pop(key))
        observed = 0
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id and rank in call.remaining:
                observed += 1
                call.rank_died(rank, info)
        return observed

    def report_failure(self, mesh_id: str, failure: MeshFailure) -> None:
        """An unobserved failure on a mesh: give it to the mesh's supervisor."""
        if mesh_id in self.meshes:
            self.io.call_soon(self.supervision.supervise, self.meshes[mesh_id], failure)
        elif mesh_id in self.memberships and self.memberships[mesh_id][0].owner != self.address:
            self.send_object(self.memberships[mesh_id][0].owner, Kind.FAILURE, mesh_id, failure)
        else:
            self.unhandled(failure)

    def report_failure_to(self, owner, failure: MeshFailure) -> None:
        """A failure of an actor mesh this process spawned: to the actor that spawned it
        (``owner``, an ActorContext; None for this process itself), on the IO thread."""
        self.io.call_soon(self.supervision.supervise_by, owner, failure)

    def unhandled(self, failure: MeshFailure) -> None:
        """Give a failure nobody handled to the unhandled hook; a broken hook is reported,
        never allowed to stop the IO thread."""
        try:
            hook = self.hooks.unhandled.current()
            if hook is not None:  # never None: the point has a default
                hook(failure)
        except Exception as e:  # noqa: BLE001  (the hook is user code; the loop must go on)
            print(f"monarch_kernel: the unhandled-failure hook raised {e!r}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ what upper layers may ask

    def death(self, mesh_id: str, rank: int) -> DeathInfo | None:
        """How ``rank`` of mesh ``mesh_id`` died, if this process knows it did."""
        return self.dead.get((mesh_id, rank))

    def busy_ranks(self, mesh_id: str) -> set[int]:
        """Ranks of ``mesh_id`` that calls made from this process still wait on."""
        busy: set[int] = set()
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id:
                busy.update(call.remaining)
        return busy

    def trust(self, mesh_ids, key: bytes) -> None:
        """Accept (and sign for) meshes of another job whose key is ``key`` (a detached mesh)."""
        self.signer.add_key(list(mesh_ids), key)

    def open_port(self, handler, once: bool = False) -> int:
        """A port of this process; ``handler(part)`` runs on the IO thread per value."""
        return self.ports.open(handler, once=once)

    def close_port(self, port_id: int) -> bool:
        return self.ports.close(port_id)

    def publish_port(self, name: str, handler) -> tuple[str, int]:
        """Open a port every process of this job can send to, as ``job_ports[name]``; the
        meshes this process spawns from now on inherit it.  Published once per name."""
        if name not in self.job_ports:
            self.job_ports[name] = (self.address, self.open_port(handler))
        return self.job_ports[name]

    def warm(self, modules) -> None:
        """Have the template import ``modules`` before it forks ranks (upper layers name the
        classes ranks will unpickle, so that each rank starts with them loaded)."""
        for name in modules:
            if name not in self.warm_modules:
                self.warm_modules.append(name)

    # ------------------------------------------------------------ links to other hosts

    def _guard(self, io: IOThread) -> None:
        """Start the ZAP handler before the first TCP bind, so no connection is let in unchecked."""
        curve = self.curve
        assert curve is not None

        def start():
            if self.gatekeeper is None:
                self.gatekeeper = Gatekeeper(self.ctx, io.loop, curve, lambda _addr: self.drops.count("curve"))

        io.run(start)

    @property
    def port_address(self) -> str:
        """Where the ports this process opens are reached.  A port travels, pickled, to
        whoever may answer it: once this process listens for other hosts it names both of its
        addresses (``ipc://...|tcp://...``) and each sender takes the one it can reach
        (``reach``), so ranks on this host keep using the local link."""
        net = self.inbox.net_address
        return f"{self.address}|{net}" if net and net != self.address else self.address

    def reach(self, address: str) -> str:
        """Which of a port's addresses this process sends to: the TCP one from a process on
        another host (whose own address is TCP), else the local one."""
        if "|" not in address:
            return address
        local, net = address.split("|", 1)
        return net if self.address.startswith("tcp://") else local

    def use_job_keys(self, curve: CurveKeys) -> None:
        """Take another job's Curve keys as this process's own (attaching to a detached mesh
        on a job's hosts).  Only before this process listens for other hosts: its links there
        would otherwise hold the old keys."""
        if curve == self.curve:
            return
        if self.net_address is not None:
            raise RuntimeError("this process already has hosts of its own, whose links use its own keys")
        self.curve = self.transport.curve = curve

    @property
    def net_address(self) -> str | None:
        """The main inbox's TCP address, once this process listens for other hosts."""
        return self.inbox.net_address

    def listen_network(self, ip: str, curve: CurveKeys | None = None) -> str:
        """Listen for processes on other hosts too: every inbox gets a TCP address on ``ip``,
        a CurveZMQ server with the job's keys (made here unless given).  Local links stay as
        they are.  Returns the main inbox's TCP address; a second call returns the same."""
        if self.net_address is not None:
            return self.net_address
        if self.curve is None:
            self.curve = self.transport.curve = curve or CurveKeys.generate()
        self._guard(self.io)
        self.bind_ip = ip
        with self.inbox.lease:
            return self.inbox.listen_tcp(ip, self.curve)

    def from_address(self, inbox: Inbox, dest: str) -> str:
        """The address of ``inbox`` a peer at ``dest`` can answer: its TCP one for a TCP peer."""
        if dest[:4] == "tcp:" and inbox.net_address is None and self.bind_ip is not None:
            with inbox.lease:
                inbox.listen_tcp(self.bind_ip, self.curve)
        return inbox.net_address if dest[:4] == "tcp:" and inbox.net_address else inbox.address

    def job_ports_for(self, dest: str) -> dict:
        """``job_ports`` as a process at ``dest`` can reach them."""
        if dest[:4] != "tcp:" or self.net_address is None:
            return dict(self.job_ports)
        return {k: (self.net_address if a == self.address else a, p) for k, (a, p) in self.job_ports.items()}

    def forget_peer(self, address: str) -> None:
        """Every thread drops its sockets to ``address`` (a process that went away)."""
        self.transport.forget(self.reach(address))

    def actor_instance(self, actor_id: str):
        """The object behind an actor hosted in this process (None if there is none)."""
        slot = self.actors.get(actor_id)
        return slot.instance if slot is not None else None

    @classmethod
    def existing(cls) -> Runtime | None:
        """This process's runtime if one was made (never makes one)."""
        return cls._current

    # ------------------------------------------------------------ lifecycle

    def _stop_process(self) -> None:
        """Kind.STOP (ProcMesh.stop): the actors stop and run ``__cleanup__``, then the
        process exits as an interpreter does (``finalize.py``), on a thread of its own so
        that the IO thread still serves the calls cleanups make."""
        if self._exiting:
            return
        self._exiting = True
        threading.Thread(target=self._exit_normally, name="monarch-exit", daemon=True).start()

    def _exit_normally(self) -> None:
        try:
            finalize.stop_actors(list(self.actors.values()))
            for slot in list(self.actors.values()):
                slot.stop()
            finalize.finalize()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                time.sleep(0.02)  # a STOP passed on to this rank's subtree leaves before we do
            finally:
                os._exit(0)

    def stats(self) -> dict:
        d = self.drops
        return {
            "sent": self.transport.sent,
            "received": self.transport.received,
            "heartbeats": self.transport.heartbeats,
            "dropped": {"unsigned": d.unsigned, "forged": d.forged, "truncated": d.truncated,
                        "oversized": d.oversized, "malformed": d.malformed, "curve": d.curve},
        }

    def shutdown(self) -> None:
        """End every mesh this process spawned; called at exit."""
        if self._closed:
            return
        self._closed = True
        self.launcher.close()
        if self.segments is not None:
            self.segments.close()
        if self._owns_rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)
