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

import zmq

from . import config, serialize, shm
from .actors import ActorSlot
from .auth import DropCounts, Dropped, Signer
from .calls import PendingCall, synthetic_part
from .completion import Completion
from .context import MeshRef, process_mesh
from .envelope import Header, Kind, Mode, Part, Status, split_parts, join_parts
from .failure import DeathInfo, MeshFailure, SendFailed
from .hooks import Hooks
from .inbox import Inbox, actor_address
from .io_thread import IOThread
from .ports import PortTable
from .serialize import dumps
from .serving import Serving
from .supervision import Supervisor
from .transport import Transport
from .tree import NodeTable, split


LEASE_RECHECK_S = 0.05  # a reader holding the inbox looks up this often


class Runtime(Serving):
    _current: "Runtime | None" = None
    _create_lock = threading.Lock()

    # ------------------------------------------------------------ creation

    @classmethod
    def current(cls) -> "Runtime":
        rt = cls._current
        if rt is None:
            with cls._create_lock:
                if cls._current is None:
                    cls._current = cls._new_controller()
                rt = cls._current
        return rt

    @classmethod
    def _new_controller(cls) -> "Runtime":
        rundir = tempfile.mkdtemp(prefix="mk-")
        os.chmod(rundir, 0o700)
        rt = cls(secrets.token_bytes(32), rundir, f"c{os.getpid()}", IOThread(), owner=None)
        rt._owns_rundir = True
        atexit.register(rt.shutdown)
        return rt

    def __init__(self, key: bytes, rundir: str, name: str, io: IOThread, owner: str | None):
        self.key = key
        self.rundir = rundir
        self._owns_rundir = False
        self.host = socket.gethostname()
        self.ctx = zmq.Context()
        self.signer = Signer(key, max_frame=config.max_frame())
        self.transport = Transport(self.ctx, self.signer)
        self.transport.io_thread = io.thread
        self.inbox = Inbox(self.ctx, f"ipc://{rundir}/{name}")
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
        self.hooks = Hooks()  # how upper layers plug in (hooks.py); nothing is installed here
        self.warm_modules: list[str] = []  # what the template imports before forking (warm())
        self.main_thread = None  # a MainThread when this is a rank (it lends it to one actor)
        self.segments = shm.Segments() if shm.available() else None
        if serialize.segments is None:
            serialize.segments = self.segments
        self.launcher = Supervisor(self)
        self.self_mesh = MeshRef(f"p{secrets.token_hex(4)}", "this_proc", (), (self.address,), self.address, (self.host,))
        self.memberships[self.self_mesh.id] = (self.self_mesh, 0)
        if process_mesh[0] is None:
            process_mesh[0], process_mesh[1] = self.self_mesh, 0
        self._closed = False
        io.call_soon(self.watch, self.inbox)

    # ------------------------------------------------------------ inbox

    # Whoever holds an inbox's lease reads it: the thread blocked on it, or else the IO
    # thread.  ``missed`` records an IO-thread wake-up that found the lease taken, so the
    # reader hands the inbox back when it stops reading.

    def watch(self, inbox: Inbox) -> None:
        """Have the IO thread read ``inbox`` too (from now on); any thread may ask."""
        if inbox.watched:
            return
        inbox.watched = True

        def register():
            self.io.loop.add_reader(inbox.sock.getsockopt(zmq.FD), self._drain, inbox)
            self._drain(inbox)

        self.io.call_soon(register)

    def _drain(self, inbox: Inbox) -> None:
        inbox.missed = True
        if not inbox.lease.acquire(blocking=False):
            return
        inbox.missed = False
        try:
            more = self._read(inbox, 10000, inline=False)
        finally:
            inbox.lease.release()
        if more:
            self.io.loop.call_soon(self._drain, inbox)  # let other callbacks run first

    def _drain_inbox(self) -> None:
        self._drain(self.inbox)

    def _read(self, inbox: Inbox, limit: int, inline: bool) -> bool:
        """Read and handle up to ``limit`` messages; True if more may be waiting.

        ``inline`` readers (threads other than the IO thread) handle replies to their own
        calls and CALLs to their own actor themselves and pass anything else on.
        """
        for i in range(limit):
            # A quick poll instead of a failing recv: raising zmq.Again costs more.
            if i and not inbox.ready():
                return False
            frames = inbox.recv()
            if frames is None:
                return False
            self.transport.received += 1
            try:
                header, body = self.signer.verify(frames)
            except Dropped as d:
                self.drops.count(d.reason)
                continue
            k = header.kind
            if not inline or k == Kind.REPLY or k == Kind.CALL:
                self._dispatch_safely(header, body)
            else:
                self.io.call_soon(self._dispatch_safely, header, body)
        return True

    def _dispatch_safely(self, header: Header, body: list) -> None:
        try:
            self._dispatch(header, body)
        except Exception as e:  # a bug in handling one message must not stop the loop
            print(f"monarch_kernel: error handling {Kind(header.kind).name}: {e!r}", file=sys.stderr)
            import traceback

            traceback.print_exc()

    def reply_inbox(self) -> Inbox:
        """The inbox replies to the calling thread's calls come back to."""
        if self.io.is_current():
            return self.inbox
        holder = getattr(self._local, "holder", None)
        if holder is None:
            with self._free_lock:
                inbox = self._free_inboxes.pop() if self._free_inboxes else None
            if inbox is None:
                inbox = Inbox(self.ctx, f"{self.address}.t{next(self._thread_inboxes)}")
            holder = self._local.holder = _ThreadInbox(self, inbox)
        return holder.inbox

    def _release_inbox(self, inbox: Inbox) -> None:
        """A thread ended: the IO thread reads its inbox (answers to calls it left behind
        still land) until another thread takes it over."""
        if any(c.inbox is inbox for c in list(self.calls.values())):
            self.watch(inbox)
        with self._free_lock:
            self._free_inboxes.append(inbox)

    def wait(self, completion: Completion, timeout: float | None, inbox: Inbox | None = None) -> bool:
        """Block until ``completion`` is done, reading ``inbox`` meanwhile if nobody is.

        The wait hook (``hooks.wait``; the kernel installs one) gets a turn between slices, outside the
        inbox lease: a rank stopped in pdb is served from the cell that waits on it.
        """
        if completion.done():
            return True
        hook = self.hooks.wait.current()
        deadline = None if timeout is None else time.monotonic() + timeout
        if inbox is None or self.io.is_current():
            if hook is None:
                return completion.wait(timeout)
            while not completion.done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                completion.wait(LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S))
                if hook.pending():
                    hook.run(completion)
            return True
        while not completion.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if hook is not None and hook.pending():
                hook.run(completion)
                continue
            slice_s = LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S)
            if not inbox.lease.acquire(blocking=False):
                completion.wait(slice_s)  # another thread is reading it for us
                continue
            try:
                while not completion.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    ms = int(1000 * (LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S)))
                    if inbox.ready(max(ms, 1)):
                        self._read(inbox, 64, inline=True)
                    elif hook is not None and hook.pending():
                        break
            finally:
                inbox.lease.release()
                if inbox.missed:
                    self.io.call_soon(self._drain, inbox)
        return True

    def _dispatch(self, h: Header, body: list) -> None:
        k = h.kind
        if k == Kind.REPLY:
            self._on_reply(h, body)
        elif k == Kind.CALL or k == Kind.SPAWN:
            self._on_call(h, body)
        elif k == Kind.HELLO:
            self.launcher.on_hello(h.mesh, h.ranks[0] if h.ranks else -1, h.extra)
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
            info = split_parts(h, body)[0].load()
            self.rank_died(h.mesh, info.rank, info)
        elif k == Kind.FAILURE:
            failure = split_parts(h, body)[0].load()
            self.launcher.on_failure_report(h.mesh, failure)
        elif k == Kind.STOP:
            self._stop_process()
        elif k == Kind.HEARTBEAT:
            self.launcher.on_heartbeat(h.mesh, h.ranks[0] if h.ranks else -1)
        elif k == Kind.WAKE:
            pass
        elif k == Kind.REVIVE:
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

    # ------------------------------------------------------------ making calls

    def call(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list,
             *, kind: int = Kind.CALL, mode: int = Mode.GATHER, slice_info=None,
             on_part=None, fanout: int | None = None, callbacks: bool = False,
             segments: list | None = None, extra=None) -> PendingCall:
        """Send ``body`` (an encoded part) to ``ranks`` of ``mesh`` through the tree.

        Replies come back to the calling thread's own inbox, unless they are consumed by
        callbacks (``on_part``, or ``callbacks=True``), which run on the IO thread.
        ``extra``: options of a SPAWN (``{"main_thread": True}``), in the slice info's place.
        """
        fanout = fanout or self.fanout
        self._check_size(body, f"the arguments of {method}")
        alive = [r for r in ranks if (mesh.id, r) not in self.dead]
        inbox = self.inbox if (on_part is not None or callbacks) else self.reply_inbox()
        h = Header(kind, next(self._ids), inbox.address, inbox.address, mesh.id, actor, method,
                   [], fanout, mode, False, 0, [], slice_info if extra is None else extra)
        h.parts = [[-1, Status.OK, len(body) - 1]]
        call = PendingCall(self, h, mesh, alive, body, on_part)
        call.inbox = inbox
        call.segments = segments
        call.remaining.update(ranks)
        self.calls[h.call_id] = call
        for r in ranks:
            if (mesh.id, r) in self.dead:
                call.add([synthetic_part(r, Status.DIED, self.dead[(mesh.id, r)])])
        for sub in split(alive, fanout):
            h.ranks = sub
            try:
                self.transport.send(self.target(mesh, sub[0], kind, actor), h, body)
            except SendFailed as e:  # the caller hears at once; the rest of the call goes on
                call.add([synthetic_part(r, Status.UNSENT, f"{e}") for r in sub])
        h.ranks = []
        late = [r for r in alive if (mesh.id, r) in self.dead]
        if late:  # died while we were sending; the death handler may have missed this call
            self.io.call_soon(lambda: [call.rank_died(r, self.dead[(mesh.id, r)]) for r in late])
        return call

    @staticmethod
    def target(mesh: MeshRef, rank: int, kind: int, actor: str) -> str:
        """CALLs go to the actor's own inbox on the rank; everything else to the rank's."""
        base = mesh.addresses[rank]
        return actor_address(base, actor) if kind == Kind.CALL else base

    def send_control(self, mesh: MeshRef, rank: int, kind: int, call_id: int = 0, extra=None,
                     origin: str | None = None) -> None:
        """A small message to a rank; ``origin`` names the inbox a call was made from, which
        is how ranks file the calls they serve."""
        origin = origin or self.address
        h = Header(kind, call_id, origin, origin, mesh.id, ranks=[rank], extra=extra)
        self.send_or_report(mesh.addresses[rank], h, [], f"{Kind(kind).name} for rank {rank} of mesh '{mesh.name}'")

    def send_object(self, address: str, kind: int, mesh_id: str, obj) -> None:
        body = dumps(obj)
        h = Header(kind, 0, self.address, self.address, mesh_id)
        h.parts = [[0, Status.OK, len(body) - 1]]
        self.send_or_report(address, h, body, f"a {Kind(kind).name} report")

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool:
        """Send a message nobody waits on; a failure is said on stderr (once per peer), since
        there is no caller to raise it to."""
        try:
            self.transport.send(address, h, body)
            return True
        except SendFailed as e:
            if address not in self._unsent_reported:
                self._unsent_reported.add(address)
                print(f"monarch_kernel: {what} was not sent: {e}", file=sys.stderr, flush=True)
            return False

    def _on_reply(self, h: Header, body: list) -> None:
        parts = split_parts(h, body)
        if h.hop == 0:
            call = self.calls.get(h.call_id)
            if call is not None and h.origin == call.inbox.address:
                call.add(parts)
            return
        st = self.nodes.add((h.origin, h.call_id), h.ranks[0], parts)
        if st is not None:
            member = self.memberships.get(h.mesh)
            self._send_reply(st, h.origin, h.call_id, member[1] if member else -1, h.mesh)

    def _send_reply(self, st, origin: str, call_id: int, me: int, mesh_id: str = "") -> None:
        h = Header(Kind.REPLY, call_id, origin, st.reply_to, mesh_id, ranks=[me], hop=1 if st.to_node else 0)
        body = join_parts(h, st.parts)
        self.send_or_report(st.reply_to, h, body, f"the answer to call {call_id} from rank {me}")

    def _check_size(self, frames: list, what: str) -> None:
        limit = self.signer.max_frame
        for f in frames:
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            if n > limit:
                raise ValueError(
                    f"{what} need a {n}-byte frame, over the {limit}-byte limit the receiver "
                    f"would drop; raise MONARCH_KERNEL_MAX_FRAME (bytes) before spawning"
                )

    def interrupt(self, mesh: MeshRef, ranks, actor: str = "", wait: float = 0.0) -> bool:
        """KeyboardInterrupt in whatever ``actor`` (or every actor) runs on those ranks.

        ``wait``: seconds to wait until every rank has delivered it (what must happen next
        may depend on it, e.g. resuming a rank stopped in a debugger); True if they all did.
        """
        alive = [r for r in ranks if (mesh.id, r) not in self.dead]
        acked: set[int] = set()
        done = threading.Event()
        port_id = None
        if wait > 0:
            def ack(part: Part) -> None:
                acked.add(part.rank)
                if acked >= set(alive):
                    done.set()

            port_id = self.ports.open(ack, once=False)
        for r in alive:
            h = Header(Kind.INTERRUPT, 0, self.address, self.address, mesh.id, actor, ranks=[r],
                       extra=None if port_id is None else [self.address, port_id])
            self.send_or_report(mesh.addresses[r], h, [], f"an interrupt for rank {r} of mesh '{mesh.name}'")
        if port_id is None:
            return True
        ok = not alive or done.wait(wait)
        self.ports.close(port_id)
        return ok

    def interrupt_actor(self, actor_id: str) -> bool:
        """In this process: KeyboardInterrupt in ``actor_id``'s running sync endpoint (any
        thread may ask; used when the IO thread itself may be held by a debugger)."""
        slot = self.actors.get(actor_id)
        return slot.interrupt() if slot is not None else False

    def send_port(self, address: str, port_id: int, part: Part, mesh_id: str | None = None) -> None:
        """Deliver one value to a port opened by the process at ``address``; ``mesh_id``:
        a mesh that process belongs to, whose key signs the message (default: our own)."""
        if address == self.address:
            self.io.call_soon(self.ports.deliver, port_id, part)
            return
        # By default sign as a member of this process's mesh: whoever opened the port talks
        # to that mesh, so it holds its key even when the mesh is another job's (detached).
        h = Header(Kind.PORT, port_id, self.address, address, mesh_id or (process_mesh[0] or self.self_mesh).id)
        self.transport.send(address, h, join_parts(h, [part]))

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
        observed = 0
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id and rank in call.remaining:
                observed += 1
                call.rank_died(rank, info)
        return observed

    def report_failure(self, mesh_id: str, failure: MeshFailure) -> None:
        """An unobserved failure on a mesh: give it to the mesh's supervisor."""
        if mesh_id in self.meshes:
            self.io.call_soon(self.launcher.supervise, self.meshes[mesh_id], failure)
        elif mesh_id in self.memberships and self.memberships[mesh_id][0].owner != self.address:
            self.send_object(self.memberships[mesh_id][0].owner, Kind.FAILURE, mesh_id, failure)
        else:
            self.unhandled(failure)

    def unhandled(self, failure: MeshFailure) -> None:
        """Give a failure nobody handled to the unhandled hook; a broken hook is reported,
        never allowed to stop the IO thread."""
        try:
            self.hooks.unhandled.current()(failure)
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

    def warm(self, modules) -> None:
        """Have the template import ``modules`` before it forks ranks (upper layers name the
        classes ranks will unpickle, so that each rank starts with them loaded)."""
        for name in modules:
            if name not in self.warm_modules:
                self.warm_modules.append(name)

    def forget_peer(self, address: str) -> None:
        """Every thread drops its sockets to ``address`` (a process that went away)."""
        self.transport.forget(address)

    def actor_instance(self, actor_id: str):
        """The object behind an actor hosted in this process (None if there is none)."""
        slot = self.actors.get(actor_id)
        return slot.instance if slot is not None else None

    @classmethod
    def existing(cls) -> "Runtime | None":
        """This process's runtime if one was made (never makes one)."""
        return cls._current

    # ------------------------------------------------------------ lifecycle

    def _stop_process(self) -> None:
        for slot in self.actors.values():
            slot.stop()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)

    def stats(self) -> dict:
        d = self.drops
        return {
            "sent": self.transport.sent,
            "received": self.transport.received,
            "dropped": {"unsigned": d.unsigned, "forged": d.forged, "truncated": d.truncated,
                        "oversized": d.oversized, "malformed": d.malformed},
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


class _ThreadInbox:
    """Thread-local owner of a thread's reply inbox: when the thread ends, the inbox goes
    back to the runtime's pool (so short-lived threads cost no descriptors), read by the IO
    thread meanwhile so replies to calls it left behind still land."""

    def __init__(self, runtime: Runtime, inbox: Inbox):
        self.runtime = runtime
        self.inbox = inbox

    def __del__(self):
        try:
            self.runtime._release_inbox(self.inbox)
        except Exception:  # interpreter shutdown
            pass
