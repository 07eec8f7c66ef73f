"""Serving calls on this process: taking a CALL or SPAWN off an inbox, forwarding it down
the tree, running the endpoint on the actor's worker (sync, or async on the worker's own
loop) and sending the answer, merged with its subtree's, up the tree.

The actors hosted here and their lives (construction, stops, aborts) are the actors' lives
part's (``actor_lives.py``); the tree state of the calls passing through is the gathering's
(``gathering.py``).  Answers go out through the answers part (``answers.py``) and forwarded
calls through the outbox, never by another route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..context import ActorContext, MeshRef, current_actor
from ..errors import SendFailed
from ..wire.envelope import Header, Kind, Mode, Part, Status, load
from ..wire.serialize import dumps
from .actor_slots import CONCURRENT_MARK, STOP_METHOD, ActorSlot
from .answers import answered_slot, lone
from .endpoint_failures import failure_part, stop_if_unobserved
from .tree import split

if TYPE_CHECKING:
    from ..hooks import Hooks
    from ..net.network import Network
    from ..net.ports import PortTable
    from ..wire.auth import DropCounts
    from .actor_lives import ActorLives
    from .answers import Answers
    from .gathering import Gathering
    from .outbox import Outbox


class Server:
    def __init__(self, *, outbox: Outbox, gathering: Gathering, answers: Answers, lives: ActorLives,
                 memberships: dict[str, tuple[MeshRef, int]], network: Network, address: str, drops: DropCounts,
                 ports: PortTable, hooks: Hooks):
        """``outbox``: what forwarded calls go out through; ``lives``: the actors hosted here;
        ``memberships``: mesh id -> (mesh, this process's rank); ``address``: this process's
        main inbox (an explicit response port is reached through it)."""
        self.outbox = outbox
        self.gathering = gathering
        self.answers = answers
        self.lives = lives
        self.actors = lives.actors  # the lives' table, read here on every call
        self.memberships = memberships
        self.network = network
        self.address = address
        self.drops = drops
        self.ports = ports
        self.hooks = hooks

    # ------------------------------------------------------------ messages

    def on_call(self, h: Header, body: list) -> None:
        member = self.memberships.get(h.mesh)
        if member is None or not h.ranks or h.ranks[0] != member[1]:
            self.drops.count("malformed")
            return
        mesh, me = member
        if lone(h):
            # Sent by the caller to this rank alone: nothing to forward, gather or repair.
            if h.kind == Kind.SPAWN:
                self.lives.spawn(h, body, mesh, me)
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
            self.lives.spawn(h, body, mesh, me)
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
        self.lives.interrupt_all(h.actor)
        if h.payload is not None:  # the caller waits until it has landed
            member = self.memberships.get(h.mesh)
            self.outbox.send_port(h.payload.address, h.payload.port, Part(member[1] if member else -1, Status.OK,
                                                                             dumps(None)), mesh_id=h.mesh)

    def complete(self, h: Header, me: int, part: Part) -> None:
        """Rank ``me``'s answer to call ``h`` (``Answers.complete``)."""
        self.answers.complete(h, me, part, answered_slot(h, self.actors))

    # ------------------------------------------------------------ running endpoints

    def _run_endpoint(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = self.actors.get(h.actor)
        if slot is None and h.method == STOP_METHOD:
            self.complete(h, me, Part(me, Status.OK, dumps(None)))  # nothing here to stop
            return
        if slot is not None and not slot.constructed.done():
            if h.method == STOP_METHOD:  # its __init__ still runs (it may never return)
                self.lives.stop_after_init(slot, h, mesh, me)
                return
            if slot.failure is not None:  # stopped while __init__ ran: say so now
                self.complete(h, me, Part(me, slot.failure.status, slot.failure.frames))
                return
            slot.constructed.add_done_callback(lambda _c: slot.submit(lambda: self._run_endpoint(h, body, mesh, me)))
            return
        if slot is not None and h.method == STOP_METHOD:
            self.lives.stop(slot, h, mesh, me)
            return
        ready = slot is not None and slot.failure is None and not slot.halted and slot.instance is not None
        refused = None if ready else self.lives.refusal(slot, h, mesh, me)
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
            part = self.answers.ok(me, h.actor, h.method, value)
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
            part = self.answers.ok(me, h.actor, h.method, value)
            value = None
        except BaseException as e:
            if port_id is not None and not self.ports.close(port_id):
                return
            part = failure_part(me, h.actor, h.method, e)
            stop_if_unobserved(slot, h, part)
        self.complete(h, me, part)
