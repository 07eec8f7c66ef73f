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
import pickle
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time

import zmq

from . import config
from .actors import ActorSlot
from .auth import DropCounts, Dropped, Signer
from .calls import PendingCall, synthetic_part
from .completion import Completion
from .context import ActorContext, MeshRef, current_actor, process_mesh
from .envelope import Header, Kind, Mode, Part, Status, split_parts, join_parts
from .failure import DeathInfo, MeshFailure, RemoteFailure
from .io_thread import IOThread
from .output import print_sink
from .serialize import describe_unpicklable, dumps
from .supervision import Supervisor
from .transport import Transport
from .tree import NodeTable, split


LEASE_RECHECK_S = 0.05  # a reader holding the inbox looks up this often
PARK_S = 30.0  # how long a call waits for its actor's SPAWN to arrive


def _default_unhandled(failure: MeshFailure) -> None:
    print(f"monarch_kernel: unhandled failure: {failure}", file=sys.stderr, flush=True)


class Runtime:
    unhandled_hook = staticmethod(_default_unhandled)  # the actor layer installs the public hook
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
        self.transport = Transport(self.ctx, f"ipc://{rundir}/{name}", self.signer)
        self.address = self.transport.address
        self.io = io
        self.owner = owner  # the process that supervises this one (None: the root)
        self.fanout = config.fanout()
        self.drops = DropCounts()
        self.calls: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)
        self.nodes = NodeTable()
        self.actors: dict[str, ActorSlot] = {}
        self.memberships: dict[str, tuple[MeshRef, int]] = {}  # mesh id -> (mesh, my rank)
        self.meshes: dict = {}  # mesh id -> OwnedMesh, for meshes this process spawned
        self.dead: dict[tuple[str, int], DeathInfo] = {}
        self.inflight: dict[tuple[str, int], int] = {}
        self.output_sink = print_sink
        self.on_unhandled = lambda failure: Runtime.unhandled_hook(failure)
        self.launcher = Supervisor(self)
        self._parked: dict[str, list] = {}  # actor id -> calls that arrived before its SPAWN
        self._parked_expired: set[str] = set()
        self.self_mesh = MeshRef(f"p{secrets.token_hex(4)}", "this_proc", (), (self.address,), self.address, (self.host,))
        self.memberships[self.self_mesh.id] = (self.self_mesh, 0)
        if process_mesh[0] is None:
            process_mesh[0], process_mesh[1] = self.self_mesh, 0
        self._closed = False
        self._lease = threading.Lock()
        self._missed = False
        io.call_soon(self._watch_inbox)

    # ------------------------------------------------------------ inbox

    def _watch_inbox(self) -> None:
        self.io.loop.add_reader(self.transport.inbox.getsockopt(zmq.FD), self._drain_inbox)
        self._drain_inbox()

    # The inbox is read by whoever holds the lease: normally the IO thread, but a thread
    # blocked in Future.get() takes it and reads replies itself, which saves two thread
    # wake-ups per call.  ``_missed`` records an IO-thread wake-up that found the lease
    # taken, so the reader hands the inbox back to the IO thread when it is done.

    def _drain_inbox(self) -> None:
        self._missed = True
        if not self._lease.acquire(blocking=False):
            return
        self._missed = False
        try:
            more = self._read_inbox(10000, inline=None)
        finally:
            self._lease.release()
        if more:
            self.io.loop.call_soon(self._drain_inbox)  # let other callbacks run first

    def _read_inbox(self, limit: int, inline) -> bool:
        """Read and handle up to ``limit`` messages; True if more may be waiting.

        With ``inline`` set (a reader other than the IO thread), replies to this process
        are handled here and everything else is passed to the IO thread.
        """
        inbox = self.transport.inbox
        for _ in range(limit):
            try:
                frames = inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            except zmq.ZMQError:
                return False
            self.transport.received += 1
            try:
                header, body = self.signer.verify(frames)
            except Dropped as d:
                self.drops.count(d.reason)
                continue
            if inline is not None and not (header.kind == Kind.REPLY and header.hop == 0):
                self.io.call_soon(self._dispatch_safely, header, body)
            else:
                self._dispatch_safely(header, body)
        return True

    def _dispatch_safely(self, header: Header, body: list) -> None:
        try:
            self._dispatch(header, body)
        except Exception as e:  # a bug in handling one message must not stop the loop
            print(f"monarch_kernel: error handling {Kind(header.kind).name}: {e!r}", file=sys.stderr)
            import traceback

            traceback.print_exc()

    def wait(self, completion: Completion, timeout: float | None) -> bool:
        """Block until ``completion`` is done, reading the inbox meanwhile if nobody is."""
        if completion.done():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        inbox = self.transport.inbox
        while not completion.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return completion.done()
            if not self._lease.acquire(blocking=False):
                completion.wait(LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S))
                continue
            try:
                while not completion.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    ms = int(LEASE_RECHECK_S * 1000) if left is None else max(0, min(int(left * 1000), int(LEASE_RECHECK_S * 1000)))
                    if inbox.poll(ms, zmq.POLLIN):
                        self._read_inbox(64, inline=True)
                    elif self._missed_elsewhere():
                        break
            finally:
                self._lease.release()
                if self._missed:
                    self.io.call_soon(self._drain_inbox)
        return True

    def _missed_elsewhere(self) -> bool:
        """Something other than the inbox may need the IO thread (never the case today)."""
        return False

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
        else:
            self.drops.count("malformed")

    # ------------------------------------------------------------ making calls

    def call(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list,
             *, kind: int = Kind.CALL, mode: int = Mode.GATHER, slice_info=None,
             on_part=None, fanout: int | None = None) -> PendingCall:
        """Send ``body`` (an encoded part) to ``ranks`` of ``mesh`` through the tree."""
        fanout = fanout or self.fanout
        alive = [r for r in ranks if (mesh.id, r) not in self.dead]
        h = Header(kind, next(self._ids), self.address, self.address, mesh.id, actor, method,
                   [], fanout, mode, False, 0, [], slice_info)
        h.parts = [[-1, Status.OK, len(body) - 1]]
        call = PendingCall(self, h, mesh, alive, body, on_part)
        call.remaining.update(ranks)
        self.calls[h.call_id] = call
        for r in ranks:
            if (mesh.id, r) in self.dead:
                call.add([synthetic_part(r, Status.DIED, self.dead[(mesh.id, r)])])
        for sub in split(alive, fanout):
            h.ranks = sub
            self.transport.send(mesh.addresses[sub[0]], h, body)
        h.ranks = []
        late = [r for r in alive if (mesh.id, r) in self.dead]
        if late:  # died while we were sending; the death handler may have missed this call
            self.io.call_soon(lambda: [call.rank_died(r, self.dead[(mesh.id, r)]) for r in late])
        return call

    def send_control(self, mesh: MeshRef, rank: int, kind: int, call_id: int = 0, extra=None) -> None:
        h = Header(kind, call_id, self.address, self.address, mesh.id, ranks=[rank], extra=extra)
        self.transport.send(mesh.addresses[rank], h, [])

    def send_object(self, address: str, kind: int, mesh_id: str, obj) -> None:
        body = dumps(obj)
        h = Header(kind, 0, self.address, self.address, mesh_id)
        h.parts = [[0, Status.OK, len(body) - 1]]
        self.transport.send(address, h, body)

    def _on_reply(self, h: Header, body: list) -> None:
        parts = split_parts(h, body)
        if h.hop == 0:
            call = self.calls.get(h.call_id)
            if call is not None and h.origin == self.address:
                call.add(parts)
            return
        st = self.nodes.add((h.origin, h.call_id), h.ranks[0], parts)
        if st is not None:
            member = self.memberships.get(h.mesh)
            self._send_reply(st, h.origin, h.call_id, member[1] if member else -1, h.mesh)

    def _send_reply(self, st, origin: str, call_id: int, me: int, mesh_id: str = "") -> None:
        h = Header(Kind.REPLY, call_id, origin, st.reply_to, mesh_id, ranks=[me], hop=1 if st.to_node else 0)
        body = join_parts(h, st.parts)
        self.transport.send(st.reply_to, h, body)

    # ------------------------------------------------------------ serving calls

    def _on_call(self, h: Header, body: list) -> None:
        member = self.memberships.get(h.mesh)
        if member is None or not h.ranks:
            self.drops.count("malformed")
            return
        mesh, me = member
        if h.ranks[0] != me:
            self.drops.count("malformed")
            return
        subs = split(h.ranks[1:], h.fanout)
        gather = h.mode == Mode.GATHER
        waiting = {me} | ({s[0] for s in subs} if gather else set())
        key = (h.origin, h.call_id)
        if not self.nodes.start(key, h.reply_to, h.hop > 0, waiting, h.resend):
            return
        if subs:
            fwd = Header(h.kind, h.call_id, h.origin, self.address if gather else h.origin, h.mesh,
                         h.actor, h.method, [], h.fanout, h.mode, h.resend,
                         1 if gather else 0, h.parts, h.extra)
            for s in subs:
                fwd.ranks = s
                self.transport.send(mesh.addresses[s[0]], fwd, body)
        if h.kind == Kind.SPAWN:
            self._spawn_actor(h, body, mesh, me)
        else:
            self._run_endpoint(h, body, mesh, me)

    def _complete(self, h: Header, me: int, part: Part) -> None:
        st = self.nodes.add((h.origin, h.call_id), me, [part])
        if st is not None:
            self._send_reply(st, h.origin, h.call_id, me, h.mesh)

    def _failure_part(self, me: int, actor: str, method: str, exc: BaseException) -> Part:
        f = RemoteFailure.capture(me, actor, method, exc)
        return Part(me, Status.RAISED, dumps(f))

    def _ok_part(self, me: int, actor: str, method: str, value) -> Part:
        try:
            return Part(me, Status.OK, dumps(value))
        except Exception as e:
            err = TypeError(f"the result of {actor}.{method} on rank {me} could not be pickled: "
                            f"{describe_unpicklable(value, e)}")
            return self._failure_part(me, actor, method, err)

    def _unpark(self, actor: str, expired: bool) -> None:
        if expired and actor not in self.actors:
            self._parked_expired.add(actor)
        for args in self._parked.pop(actor, []):
            self._run_endpoint(*args)

    def _spawn_actor(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = ActorSlot(h.actor, mesh, me)
        self.actors[h.actor] = slot
        if h.actor in self._parked:
            self.io.call_soon(self._unpark, h.actor, False)

        def construct():
            token = None
            try:
                cls, args, kwargs = Part(me, 0, body).load()
                obj = cls.__new__(cls)
                slot.instance = obj
                token = current_actor.set(ActorContext(mesh, me, h.actor, obj, me, mesh.dims))
                obj.__init__(*args, **kwargs)
                part = Part(me, Status.OK, dumps(None))
            except BaseException as e:
                part = self._failure_part(me, h.actor, "__init__", e)
                slot.instance = None
            finally:
                if token is not None:
                    current_actor.reset(token)
            slot.constructed.set_result(part.status == Status.OK)
            self._complete(h, me, part)

        slot.submit(construct)

    def _run_endpoint(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = self.actors.get(h.actor)
        if slot is None and h.actor not in self._parked_expired:
            # A SPAWN sent through another branch of the tree may still be on its way.
            parked = self._parked.setdefault(h.actor, [])
            parked.append((h, body, mesh, me))
            if len(parked) == 1:
                self.io.loop.call_later(PARK_S, self._unpark, h.actor, True)
            return
        if slot is None:
            err = LookupError(f"no actor {h.actor!r} on rank {me} of mesh '{mesh.name}' (it failed to spawn or was stopped)")
            self._complete(h, me, self._failure_part(me, h.actor, h.method, err))
            return
        if not slot.constructed.done():
            slot.constructed.add_done_callback(lambda _c: self.io.call_soon(self._run_endpoint, h, body, mesh, me))
            return
        if slot.instance is None:
            err = LookupError(f"actor {h.actor!r} on rank {me} failed in __init__; spawn it again")
            self._complete(h, me, self._failure_part(me, h.actor, h.method, err))
            return
        try:
            fn, is_async = slot.endpoint(h.method)
        except AttributeError as e:
            self._complete(h, me, self._failure_part(me, h.actor, h.method, e))
            return
        msg_rank, msg_dims = _message_point(h, me)
        ctx = ActorContext(mesh, me, h.actor, slot.instance, msg_rank, msg_dims)
        if is_async:
            self.io.loop.create_task(self._run_async(fn, ctx, h, body, me))
        else:
            slot.submit(lambda: self._run_sync(fn, ctx, h, body, me))

    def _run_sync(self, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        token = current_actor.set(ctx)
        try:
            args, kwargs = Part(me, 0, body).load()
            part = self._ok_part(me, h.actor, h.method, fn(*args, **kwargs))
        except BaseException as e:
            part = self._failure_part(me, h.actor, h.method, e)
        finally:
            current_actor.reset(token)
        self._complete(h, me, part)

    async def _run_async(self, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        current_actor.set(ctx)  # this task's own context copy
        try:
            args, kwargs = Part(me, 0, body).load()
            part = self._ok_part(me, h.actor, h.method, await fn(*args, **kwargs))
        except BaseException as e:
            part = self._failure_part(me, h.actor, h.method, e)
        self._complete(h, me, part)

    def _on_redirect(self, h: Header) -> None:
        key = (h.origin, h.call_id)
        outcome = self.nodes.redirect(key, h.origin)
        member = self.memberships.get(h.mesh)
        me = member[1] if member else -1
        if isinstance(outcome, tuple):
            st = type("S", (), {})()
            st.reply_to, st.to_node, st.parts = h.origin, False, outcome[1]
            self._send_reply(st, h.origin, h.call_id, me, h.mesh)
        elif outcome == "lost":
            back = Header(Kind.NOT_RECEIVED, h.call_id, h.origin, h.origin, h.mesh, ranks=[me])
            self.transport.send(h.origin, back, [])

    # ------------------------------------------------------------ deaths and supervision

    def rank_died(self, mesh_id: str, rank: int, info: DeathInfo) -> None:
        """On the IO thread: fail this process's calls to the rank and repair their trees."""
        if (mesh_id, rank) in self.dead:
            return
        self.dead[(mesh_id, rank)] = info
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id:
                call.rank_died(rank, info)

    def report_failure(self, mesh_id: str, failure: MeshFailure) -> None:
        """An unobserved failure on a mesh: give it to the mesh's supervisor."""
        if mesh_id in self.meshes:
            self.io.call_soon(self.launcher.supervise, self.meshes[mesh_id], failure)
        elif mesh_id in self.memberships and self.memberships[mesh_id][0].owner != self.address:
            self.send_object(self.memberships[mesh_id][0].owner, Kind.FAILURE, mesh_id, failure)
        else:
            self.on_unhandled(failure)

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
        if self._owns_rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)


def _message_point(h: Header, me: int):
    """The called slice's (flat index of this rank, dims), from the CALL's slice info."""
    info = h.extra
    if not info:
        return me, ()
    dims, ranks = info
    try:
        return ranks.index(me), tuple(tuple(d) for d in dims)
    except ValueError:
        return me, ()
