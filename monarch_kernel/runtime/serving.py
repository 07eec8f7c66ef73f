"""Serving calls on this process: taking a CALL or SPAWN off an inbox, forwarding it down
the tree, running the endpoint (sync on the actor's worker, async on the IO loop) and
sending the answer, merged with its subtree's, up the tree.

A mixin of ``Runtime``; it uses the runtime's transport, node table, actors and ports.
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import TYPE_CHECKING

from .actors import CONCURRENT_MARK, STOP_METHOD, ActorSlot
from .context import ActorContext, MeshRef, current_actor
from .envelope import Header, Kind, Mode, Part, Status
from .failure import DeathInfo, MeshFailure, RemoteFailure, SendFailed
from .serialize import describe_unpicklable, dumps
from .tree import NodeState, split

if TYPE_CHECKING:
    from .auth import DropCounts
    from .hooks import Hooks
    from .io_thread import IOThread
    from .ports import PortTable
    from .transport import Transport
    from .tree import NodeTable


class Serving:
    """How a process serves the calls that reach it (mixed into ``Runtime``)."""

    if TYPE_CHECKING:  # what Runtime.__init__ and the Calling mixin provide
        address: str
        io: IOThread
        transport: Transport
        drops: DropCounts
        hooks: Hooks
        actors: dict[str, ActorSlot]
        memberships: dict[str, tuple[MeshRef, int]]
        nodes: NodeTable
        ports: PortTable

        host: str

        @property
        def port_address(self) -> str: ...
        def target(self, mesh: MeshRef, rank: int, kind: int, actor: str) -> str: ...
        def report_failure(self, mesh_id: str, failure: MeshFailure) -> None: ...
        def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool: ...
        def _send_reply(self, st, origin: str, call_id: int, me: int, mesh_id: str = "", direct=None) -> None: ...
        def _check_size(self, frames: list, what: str) -> None: ...

    def _on_call(self, h: Header, body: list) -> None:
        member = self.memberships.get(h.mesh)
        if member is None or not h.ranks:
            self.drops.count("malformed")
            return
        mesh, me = member
        if h.ranks[0] != me:
            self.drops.count("malformed")
            return
        if _lone(h):
            # Sent by the caller to this rank alone: nothing to forward, gather or repair.
            if h.kind == Kind.SPAWN:
                self._spawn_actor(h, body, mesh, me)
            else:
                self._run_endpoint(h, body, mesh, me)
            return
        subs = split(h.ranks[1:], h.fanout)
        gather = h.mode == Mode.GATHER
        waiting = {me} | ({s[0] for s in subs} if gather else set())
        key = (h.origin, h.call_id)
        if not self.nodes.start(key, h.reply_to, h.hop > 0, waiting, h.resend):
            return
        if subs:
            # Children's answers come back to whoever serves this call here: the actor's
            # worker for CALLs (it cannot finish before its own part anyway), else the IO thread.
            back = self.target(mesh, me, h.kind, h.actor) if gather else h.origin
            fwd = Header(h.kind, h.call_id, h.origin, back, h.mesh,
                         h.actor, h.method, [], h.fanout, h.mode, h.resend,
                         1 if gather else 0, h.parts, h.extra)
            for s in subs:
                fwd.ranks = s
                try:
                    self.transport.send(self.target(mesh, s[0], h.kind, h.actor), fwd, body)
                except SendFailed:
                    # The caller knows the whole tree: it sends that subtree again itself,
                    # and its own send fails loudly if the rank is truly unreachable.
                    nack = Header(Kind.NOT_RECEIVED, h.call_id, h.origin, h.origin, h.mesh, ranks=[s[0]])
                    self.send_or_report(h.origin, nack, [], f"a NOT_RECEIVED for rank {s[0]}")
        if h.kind == Kind.SPAWN:
            self._spawn_actor(h, body, mesh, me)
        else:
            self._run_endpoint(h, body, mesh, me)

    def _complete(self, h: Header, me: int, part: Part) -> None:
        slot = self.actors.get(h.actor) if h.kind == Kind.CALL else None
        direct = ["direct", h.actor, slot.direct] if slot is not None and slot.direct else None
        if _lone(h):
            self._send_reply(NodeState(h.reply_to, False, set(), [part]), h.origin, h.call_id, me, h.mesh, direct)
            return
        st = self.nodes.add((h.origin, h.call_id), me, [part])
        if st is not None:
            self._send_reply(st, h.origin, h.call_id, me, h.mesh, direct)

    def _failure_part(self, me: int, actor: str, method: str, exc: BaseException) -> Part:
        f = RemoteFailure.capture(me, actor, method, exc)
        return Part(me, Status.RAISED, dumps(f))

    def _ok_part(self, me: int, actor: str, method: str, value) -> Part:
        try:
            frames = dumps(value)
            self._check_size(frames, f"the result of {actor}.{method} on rank {me} would")
            return Part(me, Status.OK, frames)
        except ValueError as e:
            return self._failure_part(me, actor, method, e)
        except Exception as e:
            err = TypeError(f"the result of {actor}.{method} on rank {me} could not be pickled: "
                            f"{describe_unpicklable(value, e)}")
            return self._failure_part(me, actor, method, err)

    def _spawn_actor(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = ActorSlot(h.actor, mesh, me, self)
        slot.wants_main_thread = bool(isinstance(h.extra, dict) and h.extra.get("main_thread"))
        self.actors[h.actor] = slot

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
                slot.init_failure = part  # later calls fail with this, __init__'s own traceback
            finally:
                if token is not None:
                    current_actor.reset(token)
            slot.constructed.set_result(part.status == Status.OK)
            self._complete(h, me, part)

        slot.submit(construct)

    def _run_endpoint(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        slot = self.actors.get(h.actor)
        if slot is None and h.method == STOP_METHOD:
            self._complete(h, me, Part(me, Status.OK, dumps(None)))  # nothing here to stop
            return
        if slot is None:
            err = LookupError(
                f"no actor {h.actor!r} on rank {me} of mesh '{mesh.name}' (it failed to spawn or was stopped)")
            self._complete(h, me, self._failure_part(me, h.actor, h.method, err))
            return
        if not slot.constructed.done():
            slot.constructed.add_done_callback(lambda _c: slot.submit(lambda: self._run_endpoint(h, body, mesh, me)))
            return
        if h.method == STOP_METHOD:
            self._stop_actor(slot, h, mesh, me)
            return
        if slot.failure is not None:  # stopped (or failed): say why, every time
            self._complete(h, me, Part(me, slot.failure.status, slot.failure.frames))
            return
        if slot.halted and slot.failure is None:
            # Its procs are stopping (the rank exits next): the caller hears "stopped".
            info = DeathInfo(mesh.name, me, os.getpid(), socket.gethostname(), stopped=True)
            self._complete(h, me, Part(me, Status.STOPPED, [pickle.dumps(info)]))
            return
        if slot.instance is None:
            if slot.init_failure is not None:
                self._complete(h, me, Part(me, slot.init_failure.status, slot.init_failure.frames))
                return
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
        # Everything runs on the actor's worker, one message at a time, in arrival order:
        # async endpoints on its own event loop, concurrent ones as tasks there.
        if is_async:
            concurrent = getattr(fn, CONCURRENT_MARK, False)

            def go():
                coro = self._run_async(fn, ctx, h, body, me)
                if concurrent:
                    slot.spawn(coro)
                else:
                    slot.run(coro)
        else:
            def go():
                self._run_sync(fn, ctx, h, body, me)
        if slot.is_current() and not slot.deferring:
            go()
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
                slot.failure = self._failure_part(me, h.actor, "", err)  # no method: it answers every call
            slot.halt(None)
            self._complete(h, me, Part(me, Status.OK, dumps(None)))
        if slot.is_current() and not slot.deferring:
            go()
        else:
            slot.submit(go)

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
        slot.failure = self._failure_part(me, actor_id, "", err)
        slot.submit(lambda: slot.halt(err))
        text = (f"actor {cls} '{actor_id}' on rank {me} of mesh '{mesh.name}' (host {self.host}) aborted: "
                f"{reason}")
        self.report_failure(mesh.id, MeshFailure(mesh.name, me, text, remote=slot.failure.load()))

    def _response_port(self, h: Header, me: int) -> tuple[int, tuple]:
        """For ``@endpoint(explicit_response_port=True)``: a port that answers this call."""
        port_id = self.ports.open(lambda part: self._complete(h, me, Part(me, part.status, part.frames)), once=True)
        return port_id, (self.port_address, port_id, me)

    def _run_sync(self, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        token = current_actor.set(ctx)
        port_id = None
        try:
            args, kwargs = Part(me, 0, body).load()
            slot = self.actors[h.actor]
            if getattr(fn, "__monarch_port__", False):
                port_id, port = self._response_port(h, me)
                with slot.running():
                    fn(port, *args, **kwargs)  # the actor layer turns the triple into a Port
                return
            with slot.running():
                value = fn(*args, **kwargs)
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
            part = self._failure_part(me, h.actor, h.method, e)
            self._stop_if_unobserved(h, me, part)
        finally:
            current_actor.reset(token)
        self._complete(h, me, part)

    async def _run_async(self, fn, ctx: ActorContext, h: Header, body: list, me: int) -> None:
        current_actor.set(ctx)  # this task's own context copy
        port_id = None
        try:
            args, kwargs = Part(me, 0, body).load()
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
            part = self._failure_part(me, h.actor, h.method, e)
            self._stop_if_unobserved(h, me, part)
        self._complete(h, me, part)

    def _stop_if_unobserved(self, h: Header, me: int, part: Part) -> None:
        """An exception escaped an endpoint called with ``broadcast`` (nobody waits for its
        answer): as in Monarch the actor stops, and every later call to it fails with this.
        The caller's runtime still reports the failure to the actor mesh's owner."""
        if isinstance(h.extra, list) and len(h.extra) > 2 and h.extra[2]:
            slot = self.actors.get(h.actor)
            if slot is not None and slot.failure is None:
                slot.failure = part

    def _on_redirect(self, h: Header) -> None:
        key = (h.origin, h.call_id)
        outcome = self.nodes.redirect(key, h.origin)
        member = self.memberships.get(h.mesh)
        me = member[1] if member else -1
        if isinstance(outcome, tuple):
            self._send_reply(NodeState(h.origin, False, set(), outcome[1]), h.origin, h.call_id, me, h.mesh)
        elif outcome == "lost":
            back = Header(Kind.NOT_RECEIVED, h.call_id, h.origin, h.origin, h.mesh, ranks=[me])
            self.send_or_report(h.origin, back, [], f"a NOT_RECEIVED from rank {me}")


def _lone(h: Header) -> bool:
    """A call the caller sent straight to one rank (in GATHER mode forwarded calls have
    hop 1): no tree state is needed for it, since nothing can be redirected to it."""
    return h.hop == 0 and h.mode == Mode.GATHER and len(h.ranks) == 1 and not h.resend

def _message_point(h: Header, me: int):
    """The called slice's (flat index of this rank, dims), from the CALL's slice info."""
    info = h.extra
    if not info:
        return me, None
    dims, ranks = info[0], info[1]
    try:
        return ranks.index(me), tuple(tuple(d) for d in dims)
    except ValueError:
        return me, None
