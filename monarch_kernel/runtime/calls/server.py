"""Serving calls on this process: taking a CALL or SPAWN off an inbox, forwarding it down
the tree, running the endpoint on the actor's worker (sync, or async on the worker's own
loop) and sending the answer, merged with its subtree's, up the tree.

It owns the actors hosted here; the tree state of the calls passing through is the
gathering part's (``gathering.py``).  Answers and forwarded calls go out through the outbox
it is given (``Outbox.send_reply``), never by another route.  It is given the caller (the
stops of actor meshes its actors spawned), the signer (the frame limit), the network (actors'
inboxes, the ports' address), the port table, the hooks, the IO thread
and the runtime behaviours it uses (``report_failure``, the meshes this process spawned and
their stop, the rank's main thread); the receiver and the memberships, built after it, are
handed over through ``attach``.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from typing import TYPE_CHECKING

from .. import config
from ..context import ActorContext, MeshRef, actor_name, current_actor
from ..errors import SendFailed
from ..failure import DeathInfo, MeshFailure
from ..wire.envelope import Header, Kind, Mode, Part, Status, load
from ..wire.payloads import ReplyInfo
from ..wire.serialize import describe_unpicklable, dumps
from .actor_slots import CONCURRENT_MARK, STOP_METHOD, ActorSlot
from .endpoint_failures import failure_part, report_told, stop_if_unobserved
from .gathering import Gathering
from .tree import split

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..completion import Completion
    from ..hooks import Hooks
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..net.ports import PortTable
    from ..net.receiver import Receiver
    from ..spawn.owned_mesh import OwnedMesh
    from ..wire.auth import DropCounts, Signer
    from .caller import Caller
    from .main_thread import MainThread
    from .outbox import Outbox

STOP_INIT_GRACE_S = config.seconds("stop_init_grace")


class Server:
    receiver: Receiver  # handed over by ``attach``, as is ``memberships``
    memberships: dict[str, tuple[MeshRef, int]]

    def __init__(self, *, outbox: Outbox, caller: Caller, signer: Signer, network: Network, address: str,
                 drops: DropCounts, ports: PortTable, hooks: Hooks, io: IOThread, host: str,
                 report_failure: Callable[[str, MeshFailure], None], main_thread: Callable[[], MainThread | None],
                 owned_meshes: Callable[[], list[OwnedMesh]], stop_mesh: Callable[[OwnedMesh], Completion]):
        """``outbox``: what answers and forwarded calls go out through; ``caller``: what the
        stops of actor meshes spawned here are sent with; ``address``: this process's main
        inbox; ``main_thread()``: the rank's MainThread, once it lends it (None in the
        controller); ``owned_meshes``/``stop_mesh``: the proc meshes this process spawned, and
        how one is stopped (an actor's stop stops those it spawned)."""
        self.outbox = outbox
        self.caller = caller
        self.signer = signer
        self.network = network
        self.address = address
        self.drops = drops
        self.ports = ports
        self.hooks = hooks
        self.io = io
        self.host = host
        self.report_failure = report_failure
        self.main_thread = main_thread
        self.owned_meshes = owned_meshes
        self.stop_mesh = stop_mesh
        self.gathering = Gathering(outbox=outbox, drops=drops, my_rank=self._my_rank)  # the calls this rank forwards
        self.actors: dict[str, ActorSlot] = {}
        # actor id -> the actor meshes it spawned: (proc mesh, actor id, ranks); they stop with it
        self.spawned: dict[str, list[tuple[MeshRef, str, list[int]]]] = {}

    def attach(self, receiver: Receiver, memberships: dict[str, tuple[MeshRef, int]]) -> None:
        """Hand over what the runtime builds after the server: the receiver (it reads actors'
        inboxes) and the runtime's memberships (mesh id -> (mesh, this process's rank))."""
        self.receiver = receiver
        self.memberships = memberships

    # ------------------------------------------------------------ messages

    def on_call(self, h: Header, body: list) -> None:
        member = self.memberships.get(h.mesh)
        if member is None or not h.ranks or h.ranks[0] != member[1]:
            self.drops.count("malformed")
            return
        mesh, me = member
        if _lone(h):
            # Sent by the caller to this rank alone: nothing to forward, gather or repair.
            if h.kind == Kind.SPAWN:
                self._spawn_actor(h, body, mesh, me)
            else:
                self._run_endpoint(h, body, mesh, me)
            return
        if h.mode == Mode.TELL:  # never forwarded: see Caller.tell
            self.drops.count("malformed")
            return
        subs = split(h.ranks[1:], h.fanout)
        gather = h.mode == Mode.GATHER
        waiting = {me} | ({s[0] for s in subs} if gather else set())
        if not self.gathering.start(h, waiting):
            return
        if subs:
            self._forward(h, body, mesh, me, subs, gather)
        if h.kind == Kind.SPAWN:
            self._spawn_actor(h, body, mesh, me)
        else:
            self._run_endpoint(h, body, mesh, me)

    def _forward(self, h: Header, body: list, mesh: MeshRef, me: int, subs: list, gather: bool) -> None:
        # Children's answers come back to whoever serves this call here: the actor's worker
        # for CALLs (it cannot finish before its own part anyway), else the IO thread.
        outbox = self.outbox
        back = outbox.target(mesh, me, h.kind, h.actor) if gather else h.origin
        fwd = Header.forward(h, [], back, 1 if gather else 0)
        for s in subs:
            fwd.ranks = s
            try:
                outbox.send(outbox.target(mesh, s[0], h.kind, h.actor), fwd, body)
            except SendFailed:
                # The caller knows the whole tree: it sends that subtree again itself, and
                # its own send fails loudly if the rank is truly unreachable.
                outbox.send_or_report(h.origin, Header.not_received(h, s[0]), [], f"a NOT_RECEIVED for rank {s[0]}")

    def on_interrupt(self, h: Header, _body: list) -> None:
        for actor_id, slot in list(self.actors.items()):
            if not h.actor or actor_id == h.actor:
                slot.interrupt()
        if h.payload is not None:  # the caller waits until it has landed
            self.outbox.send_port(h.payload.address, h.payload.port, Part(self._my_rank(h.mesh), Status.OK,
                                                                             dumps(None)), mesh_id=h.mesh)

    def _my_rank(self, mesh_id: str) -> int:
        member = self.memberships.get(mesh_id)
        return member[1] if member else -1

    # ------------------------------------------------------------ answers

    def complete(self, h: Header, me: int, part: Part) -> None:
        slot = self.actors.get(h.actor) if h.kind == Kind.CALL else None
        if h.mode == Mode.TELL:  # nobody waits for it: only a failure is heard, by supervision
            if part.status == Status.RAISED:
                report_told(self.memberships, self.report_failure, h, me, part, slot)
            return
        direct = ReplyInfo(h.actor, slot.direct) if slot is not None and slot.direct else None
        if _lone(h):
            self.outbox.send_parts(h.reply_to, False, [part], h.origin, h.call_id, me, h.mesh, direct)
            return
        self.gathering.answer(h, me, part, direct)

    def _ok_part(self, me: int, actor: str, method: str, value) -> Part:
        try:
            frames = dumps(value)
            if self.signer.oversized(frames):
                self.signer.check_size(frames, f"the result of {actor}.{method} on rank {me} would")
            return Part(me, Status.OK, frames)
        except ValueError as e:
            return failure_part(me, actor, method, e)
        except Exception as e:
            err = TypeError(f"the result of {actor}.{method} on rank {me} could not be pickled: "
                            f"{describe_unpicklable(value, e)}")
            return failure_part(me, actor, method, err)

    # ------------------------------------------------------------ actors

    def _spawn_actor(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = ActorSlot(h.actor, mesh, me, self.network, self.receiver, self.main_thread(), self.stop_spawned)
        slot.wants_main_thread = bool(h.payload is not None and h.kind == Kind.SPAWN and h.payload.main_thread)
        self.actors[h.actor] = slot

        def construct():
            token = None
            # While __init__ runs (it may never return) the IO thread reads the actor's inbox:
            # calls queue behind __init__, and a stop need not wait for it (``_stop_after_init``).
            assert slot.inbox is not None
            self.receiver.watch(slot.inbox)
            try:
                cls, args, kwargs = load(body)
                obj = cls.__new__(cls)
                slot.instance = obj
                slot.init_started = time.monotonic()
                token = current_actor.set(ActorContext(mesh, me, h.actor, obj, me, mesh.dims))
                obj.__init__(*args, **kwargs)
                part = Part(me, Status.OK, dumps(None))
            except BaseException as e:
                part = failure_part(me, h.actor, "__init__", e)
                slot.instance = None
                slot.init_failure = part  # later calls fail with this, __init__'s own traceback
            finally:
                if token is not None:
                    current_actor.reset(token)
            with slot.inbox.lease:  # the IO thread is not inside a read: what it read is queued
                self.receiver.unwatch(slot.inbox)
                slot.constructed.set_result(part.status == Status.OK)
            self.complete(h, me, part)

        slot.submit(construct)

    def _refusal(self, slot: ActorSlot | None, h: Header, mesh: MeshRef, me: int) -> Part | None:
        """Why ``slot`` cannot run this call now (a failure Part), or None if it can."""
        if slot is None:
            err = LookupError(
                f"no actor {h.actor!r} on rank {me} of mesh '{mesh.name}' (it failed to spawn or was stopped)")
            return failure_part(me, h.actor, h.method, err)
        if slot.failure is not None:  # stopped (or failed): say why, every time
            return Part(me, slot.failure.status, slot.failure.frames)
        if slot.halted:
            # Its procs are stopping (the rank exits next): the caller hears "stopped".
            info = DeathInfo(mesh.name, me, os.getpid(), socket.gethostname(), stopped=True)
            return Part(me, Status.STOPPED, [pickle.dumps(info)])
        if slot.instance is None:
            if slot.init_failure is not None:
                return Part(me, slot.init_failure.status, slot.init_failure.frames)
            err = LookupError(f"actor {h.actor!r} on rank {me} failed in __init__; spawn it again")
            return failure_part(me, h.actor, h.method, err)
        return None

    def _run_endpoint(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = self.actors.get(h.actor)
        if slot is None and h.method == STOP_METHOD:
            self.complete(h, me, Part(me, Status.OK, dumps(None)))  # nothing here to stop
            return
        if slot is not None and not slot.constructed.done():
            if h.method == STOP_METHOD:  # its __init__ still runs (it may never return)
                self._stop_after_init(slot, h, body, mesh, me)
                return
            if slot.failure is not None:  # stopped while __init__ ran: say so now
                self.complete(h, me, Part(me, slot.failure.status, slot.failure.frames))
                return
            slot.constructed.add_done_callback(lambda _c: slot.submit(lambda: self._run_endpoint(h, body, mesh, me)))
            return
        if slot is not None and h.method == STOP_METHOD:
            self._stop_actor(slot, h, mesh, me)
            return
        ready = slot is not None and slot.failure is None and not slot.halted and slot.instance is not None
        refused = None if ready else self._refusal(slot, h, mesh, me)
        if refused is not None or slot is None:  # (no slot is always refused)
            self.complete(h, me, refused or failure_part(me, h.actor, h.method, LookupError(h.actor)))
            return
        try:
            fn, is_async = slot.endpoint(h.method)
        except AttributeError as e:
            self.complete(h, me, failure_part(me, h.actor, h.method, e))
            return
        msg_rank, msg_dims = h.payload.point(me) if h.payload is not None else (me, None)
        ctx = ActorContext(mesh, me, h.actor, slot.instance, msg_rank, msg_dims)
        # Everything runs on the actor's worker, one message at a time, in arrival order:
        # async endpoints on its own event loop, concurrent ones as tasks there.
        if is_async:
            concurrent = getattr(fn, CONCURRENT_MARK, False)

            def go():
                coro = self._run_async(slot, fn, ctx, h, body, me)
                if concurrent:
                    slot.spawn(coro)
                else:
                    slot.run(coro)
        elif slot.is_current() and not slot.deferring:
            self._run_sync(slot, fn, ctx, h, body, me)  # the worker read this call itself: no hand-off
            return
        else:
            def go():
                self._run_sync(slot, fn, ctx, h, body, me)
        if slot.is_current() and not slot.deferring:
            go()  # the worker read this call itself: no hand-off
        else:
            slot.submit(go)

    def _stop_actor(self, slot: ActorSlot, h: Header, mesh: MeshRef, me: int) -> None:
        """ActorMesh.stop() on this rank: after the messages before it, the actor stops
        (``ActorSlot.halt``) and every later call fails saying so; its process lives on."""
        def go():
            if slot.failure is None:
                cls = type(slot.instance).__qualname__ if slot.instance is not None else "actor"
                err = RuntimeError(f"Actor {cls} '{slot.actor_id}' on rank {me} of mesh '{mesh.name}' is "
                                   f"stopped: ActorMesh.stop() stopped it. Spawn it again to call it.")
                slot.failure = failure_part(me, h.actor, "", err)  # no method: it answers every call
            slot.halt(None)
            self.complete(h, me, Part(me, Status.OK, dumps(None)))
        if slot.is_current() and not slot.deferring:
            go()
        else:
            slot.submit(go)

    def _stop_after_init(self, slot: ActorSlot, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        """ActorMesh.stop() while ``__init__`` runs: the usual stop once it returns (then
        ``__cleanup__`` runs), unless it runs ``stop_init_grace`` longer: then at once."""
        first = threading.Lock()  # whichever comes first, once

        def constructed(_c) -> None:
            if first.acquire(blocking=False):
                slot.submit(lambda: self._run_endpoint(h, body, mesh, me))

        def late() -> None:  # on the IO thread; the grace counts from __init__'s start
            started = slot.init_started
            left = STOP_INIT_GRACE_S - (time.monotonic() - started) if started is not None else STOP_INIT_GRACE_S
            if left > 0:  # (its class and arguments may still be loading: their imports)
                self.io.loop.call_later(left, late)
            elif first.acquire(blocking=False):
                self._stop_unconstructed(slot, h, mesh, me)

        slot.constructed.add_done_callback(constructed)
        self.io.call_soon(self.io.loop.call_later, STOP_INIT_GRACE_S, late)

    def _stop_unconstructed(self, slot: ActorSlot, h: Header, mesh: MeshRef, me: int) -> None:
        """ActorMesh.stop() while ``__init__`` runs: the actor is stopped at once (every call
        fails saying so, and the stop returns, as in Monarch); its worker is left to finish
        ``__init__``, if it ever does, and then refuses what was queued behind it."""
        if slot.failure is None:
            err = RuntimeError(f"Actor '{actor_name(slot.actor_id)}' on rank {me} of mesh '{mesh.name}' is stopped: "
                               f"ActorMesh.stop() stopped it before its __init__ returned. Spawn it again to call it.")
            slot.failure = failure_part(me, h.actor, "", err)
        slot.halted = True  # no __cleanup__: there is no constructed instance to clean up
        self.complete(h, me, Part(me, Status.OK, dumps(None)))

    def abort_actor(self, actor_id: str, reason: str) -> None:
        """``context().actor_instance.abort(reason)``: the actor fails with ``reason``, as in
        Monarch; later calls fail with it, its concurrent endpoints are cancelled and its
        ``__cleanup__`` runs once the current message ends, and its supervisor hears."""
        slot = self.actors.get(actor_id)
        if slot is None:
            raise LookupError(f"no actor {actor_id!r} in this process to abort")
        if slot.failure is not None:
            return  # it already stopped or failed: the first reason stands
        mesh, me = slot.mesh, slot.rank
        cls = type(slot.instance).__qualname__ if slot.instance is not None else "actor"
        err = RuntimeError(f"Actor {cls} '{actor_id}' on rank {me} of mesh '{mesh.name}' aborted: {reason}")
        slot.failure = failure_part(me, actor_id, "", err)
        slot.submit(lambda: slot.halt(err))
        text = (f"actor {cls} '{actor_id}' on rank {me} of mesh '{mesh.name}' (host {self.host}) aborted: "
                f"{reason}")
        self.report_failure(mesh.id, MeshFailure(mesh.name, me, text, remote=slot.failure.load()))

    def note_spawned(self, owner: str, ref: MeshRef, actor_id: str, ranks: list[int]) -> None:
        """Actor ``owner`` (hosted here) spawned actor mesh ``actor_id`` on ``ranks`` of
        ``ref``: it stops when ``owner`` does (``stop_spawned``)."""
        if owner in self.actors:
            self.spawned.setdefault(owner, []).append((ref, actor_id, list(ranks)))

    def stop_spawned(self, owner: str, timeout: float) -> None:
        """On ``owner``'s worker, as it stops: the actor meshes it spawned stop too (their
        ``__cleanup__`` runs, and so on down), and so do the proc meshes it spawned, as in
        Monarch.  Waits at most ``timeout`` s for them; the stops go on regardless."""
        waits = []
        for ref, child, ranks in self.spawned.pop(owner, ()):
            live = [r for r in ranks if self.caller.dead.get((ref.id, r)) is None]
            if not live:
                continue
            try:
                pending = self.caller.call(ref, child, STOP_METHOD, live, dumps(((), {})))
            except SendFailed:
                continue  # its ranks are gone: nothing left to stop
            waits.append((pending.completion, pending.inbox))
        for om in self.owned_meshes():
            if om.owner_actor is not None and om.owner_actor.actor == owner and not om.stopping:
                waits.append((self.stop_mesh(om), None))
        deadline = time.monotonic() + timeout
        for completion, inbox in waits:
            self.receiver.wait(completion, max(0.0, deadline - time.monotonic()), inbox)

    def actor_instance(self, actor_id: str):
        """The object behind an actor hosted in this process (None if there is none)."""
        slot = self.actors.get(actor_id)
        return slot.instance if slot is not None else None

    def interrupt_actor(self, actor_id: str) -> bool:
        """In this process: KeyboardInterrupt in ``actor_id``'s running sync endpoint (any
        thread may ask; used when the IO thread itself may be held by a debugger)."""
        slot = self.actors.get(actor_id)
        return slot.interrupt() if slot is not None else False

    # ------------------------------------------------------------ running endpoints

    def _response_port(self, h: Header, me: int) -> tuple[int, tuple]:
        """For ``@endpoint(explicit_response_port=True)``: a port that answers this call."""
        port_id = self.ports.open(lambda part: self.complete(h, me, Part(me, part.status, part.frames)), once=True)
        return port_id, (self.network.port_address(self.address), port_id, me)

    def _run_sync(self, slot: ActorSlot, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        token = current_actor.set(ctx)
        port_id = None
        try:
            args, kwargs = load(body)
            if getattr(fn, "__monarch_port__", False):
                port_id, port = self._response_port(h, me)
                with slot.running():
                    fn(port, *args, **kwargs)  # the actor layer turns the triple into a Port
                return
            slot.enter()
            try:
                value = fn(*args, **kwargs)
            finally:
                slot.leave()
            # Let go of the arguments before answering: an argument mapped from shared
            # memory must be unmapped by the time the caller may reuse its segment.
            args = kwargs = None
            part = self._ok_part(me, h.actor, h.method, value)
            value = None
        except BaseException as e:
            if port_id is not None and not self.ports.close(port_id):
                return  # it already answered through the port
            hook = self.hooks.endpoint_error.current()
            if hook is not None and isinstance(e, Exception):
                hook(e)  # may stop here in post-mortem pdb before the caller hears of it
            part = failure_part(me, h.actor, h.method, e)
            stop_if_unobserved(slot, h, part)
        finally:
            current_actor.reset(token)
        self.complete(h, me, part)

    async def _run_async(self, slot: ActorSlot, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        current_actor.set(ctx)  # this task's own context copy
        port_id = None
        try:
            args, kwargs = load(body)
            if getattr(fn, "__monarch_port__", False):
                port_id, port = self._response_port(h, me)
                await fn(port, *args, **kwargs)
                return
            value = await fn(*args, **kwargs)
            args = kwargs = None  # see _run_sync
            part = self._ok_part(me, h.actor, h.method, value)
            value = None
        except BaseException as e:
            if port_id is not None and not self.ports.close(port_id):
                return
            part = failure_part(me, h.actor, h.method, e)
            stop_if_unobserved(slot, h, part)
        self.complete(h, me, part)


def _lone(h: Header) -> bool:
    """A call the caller sent straight to one rank (forwarded GATHER calls have hop 1, and a
    TELL is never forwarded): it needs no tree state, since nothing can be redirected to it."""
    return h.hop == 0 and h.mode != Mode.DIRECT and len(h.ranks) == 1 and not h.resend
