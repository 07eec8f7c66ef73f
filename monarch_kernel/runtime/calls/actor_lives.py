"""The lives of the actors hosted in this process: constructing one (``__init__`` on its
worker, while the IO thread reads its inbox), stopping one (after the messages before the
stop, or at once if ``__init__`` runs too long), aborting one, and stopping with it the actor
and proc meshes it spawned.

It owns the table of hosted actors (``actors``) and what each spawned; serving their calls
is the server's (``server.py``), and every answer goes out through the answers part it is
given.  It never decides what a failure means (the supervision policy does).
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import config
from ..context import ActorContext, MeshRef, actor_name, current_actor
from ..errors import SendFailed
from ..failure import DeathInfo, MeshFailure
from ..wire.envelope import Header, Kind, Part, Status, load
from ..wire.serialize import dumps
from .actor_slots import STOP_METHOD, ActorSlot
from .endpoint_failures import failure_part

if TYPE_CHECKING:
    from ..completion import Completion
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..net.receiver import Receiver
    from ..spawn.owned_mesh import OwnedMesh
    from .answers import Answers
    from .caller import Caller
    from .main_thread import MainThread

STOP_INIT_GRACE_S = config.seconds("stop_init_grace")


class ActorLives:
    def __init__(self, *, answers: Answers, caller: Caller, receiver: Receiver, network: Network, io: IOThread,
                 host: str, main_thread: MainThread | None, meshes: dict[str, OwnedMesh],
                 stop_mesh: Callable[[OwnedMesh], Completion], report_failure: Callable[[str, MeshFailure], None]):
        """``caller``: what the stops of actor meshes spawned here are sent with;
        ``main_thread``: the rank's (lent to one actor that asks), None in the controller;
        ``meshes``: the proc meshes this process spawned (an actor's stop stops those it
        spawned, with ``stop_mesh``); ``report_failure``: where an abort is reported."""
        self.answers = answers
        self.caller = caller
        self.receiver = receiver
        self.network = network
        self.io = io
        self.host = host
        self.main_thread = main_thread
        self.meshes = meshes
        self.stop_mesh = stop_mesh
        self.report_failure = report_failure
        self.actors: dict[str, ActorSlot] = {}
        # actor id -> the actor meshes it spawned: (proc mesh, actor id, ranks); they stop with it
        self.spawned: dict[str, list[tuple[MeshRef, str, list[int]]]] = {}

    # ------------------------------------------------------------ construction

    def spawn(self, h: Header, body: list, mesh: MeshRef, me: int) -> None:
        """A SPAWN for rank ``me``: a slot and its worker, which runs ``__init__`` and answers."""
        slot = ActorSlot(h.actor, mesh, me, self.network, self.receiver, self.main_thread, self.stop_spawned)
        slot.wants_main_thread = bool(h.payload is not None and h.kind == Kind.SPAWN and h.payload.main_thread)
        self.actors[h.actor] = slot
        answers, receiver = self.answers, self.receiver

        def construct():
            token = None
            # While __init__ runs (it may never return) the IO thread reads the actor's inbox:
            # calls queue behind __init__, and a stop need not wait for it (``stop_after_init``).
            assert slot.inbox is not None
            receiver.watch(slot.inbox)
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
                receiver.unwatch(slot.inbox)
                slot.constructed.set_result(part.status == Status.OK)
            answers.complete(h, me, part, None)  # (a SPAWN: no slot's address goes with it)

        slot.submit(construct)

    def refusal(self, slot: ActorSlot | None, h: Header, mesh: MeshRef, me: int) -> Part | None:
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

    # ------------------------------------------------------------ stops

    def stop(self, slot: ActorSlot, h: Header, mesh: MeshRef, me: int) -> None:
        """ActorMesh.stop() on this rank: after the messages before it, the actor stops
        (``ActorSlot.halt``) and every later call fails saying so; its process lives on."""
        def go():
            if slot.failure is None:
                cls = type(slot.instance).__qualname__ if slot.instance is not None else "actor"
                err = RuntimeError(f"Actor {cls} '{slot.actor_id}' on rank {me} of mesh '{mesh.name}' is "
                                   f"stopped: ActorMesh.stop() stopped it. Spawn it again to call it.")
                slot.failure = failure_part(me, h.actor, "", err)  # no method: it answers every call
            slot.halt(None)
            self.answers.complete(h, me, Part(me, Status.OK, dumps(None)), slot)
        if slot.is_current() and not slot.deferring:
            go()
        else:
            slot.submit(go)

    def stop_after_init(self, slot: ActorSlot, h: Header, mesh: MeshRef, me: int) -> None:
        """ActorMesh.stop() while ``__init__`` runs: the usual stop once it returns (then
        ``__cleanup__`` runs), unless it runs ``stop_init_grace`` longer: then at once."""
        first = threading.Lock()  # whichever comes first, once

        def constructed(_c) -> None:
            if first.acquire(blocking=False):
                slot.submit(lambda: self.stop(slot, h, mesh, me))

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
        self.answers.complete(h, me, Part(me, Status.OK, dumps(None)), slot)

    def abort(self, actor_id: str, reason: str) -> None:
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
        for om in list(self.meshes.values()):
            if om.owner_actor is not None and om.owner_actor.actor == owner and not om.stopping:
                waits.append((self.stop_mesh(om), None))
        deadline = time.monotonic() + timeout
        for completion, inbox in waits:
            self.receiver.wait(completion, max(0.0, deadline - time.monotonic()), inbox)

    # ------------------------------------------------------------ asked from any thread

    def instance(self, actor_id: str):
        """The object behind an actor hosted in this process (None if there is none)."""
        slot = self.actors.get(actor_id)
        return slot.instance if slot is not None else None

    def serving(self) -> bool:
        """Whether an actor hosted here runs a sync endpoint's code now (an async endpoint may
        wait forever by design: a server's loop)."""
        return any(slot.busy() for slot in list(self.actors.values()))

    def interrupt(self, actor_id: str) -> bool:
        """KeyboardInterrupt in ``actor_id``'s running sync endpoint (any thread may ask;
        used when the IO thread itself may be held by a debugger)."""
        slot = self.actors.get(actor_id)
        return slot.interrupt() if slot is not None else False

    def interrupt_all(self, actor: str) -> None:
        """KeyboardInterrupt in ``actor``'s running endpoint, or in every actor's (``""``)."""
        for actor_id, slot in list(self.actors.items()):
            if not actor or actor_id == actor:
                slot.interrupt()
