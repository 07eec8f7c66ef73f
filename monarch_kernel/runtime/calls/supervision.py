"""The supervision policy: what a rank's death or a reported failure means, and who hears it.

A death is handled once the launcher has recorded it: the calls waiting on the rank fail at
once (``ProcessDied``), every mesh that might call it is told (``Kind.DEATH``; ``Kind.REVIVE``
once it is restarted, after ``Kind.MOVED`` when it restarts on another host), the mesh's
spawn or restart in progress fails; a death nobody was waiting for becomes a supervision
event for the spawning actor's ``__supervise__``, or goes up the chain of owners to the
controller's unhandled-fault hook.  It decides; it never starts or ends a process.

It is given what it uses, not the runtime: the IO thread, the outbox (to tell meshes and
owners), the caller (to fail the calls waiting on a dead rank, and to forget deaths), the
actors' lives (whose ``__supervise__`` runs), the runtime's tables of owned meshes and of
memberships, the hooks (death hooks, the root's unhandled-failure hook), this process's
owner, and ``shutting_down`` (whether this process is closing).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..context import MeshRef, actor_path, process_mesh
from ..errors import ProcessDied
from ..failure import DeathInfo, MeshFailure
from ..spawn.owned_mesh import OwnedMesh
from ..wire.envelope import Kind
from ..wire.payloads import DeathNotice, MovedNotice, ReviveNotice
from ..wire.serialize import dumps

if TYPE_CHECKING:
    from ..hooks import Hooks
    from ..net.io_thread import IOThread
    from .actor_lives import ActorLives
    from .caller import Caller
    from .outbox import Outbox

log = logging.getLogger("monarch_kernel.runtime")


class SupervisionPolicy:
    """Held by the runtime as ``rt.supervision``; every method runs on the IO thread."""

    def __init__(self, *, io: IOThread, outbox: Outbox, caller: Caller, lives: ActorLives,
                 meshes: dict[str, OwnedMesh], memberships: dict[str, tuple[MeshRef, int]], hooks: Hooks,
                 owner: str | None, shutting_down: Callable[[], bool]):
        self.io, self.outbox, self.caller, self.lives = io, outbox, caller, lives
        self.meshes, self.memberships, self.hooks = meshes, memberships, hooks
        self.owner = owner  # the process that supervises this one (None: the root)
        self.shutting_down = shutting_down
        # mesh id -> the actor meshes spawned on it: (spawner, class name, actor id, ranks)
        self._hosted: dict[str, list[tuple]] = {}

    def rank_died(self, mesh_id: str, rank: int, info: DeathInfo) -> int:
        """On the IO thread: fail this process's calls to the rank and repair their trees.
        Returns how many calls were waiting on it (and so now hold a ``ProcessDied``)."""
        ref = self.meshes[mesh_id].ref if mesh_id in self.meshes else self.memberships.get(mesh_id, (None,))[0]
        return self.caller.rank_died(mesh_id, rank, info, ref)

    def unhandled(self, failure: MeshFailure) -> None:
        unhandled(self.hooks, failure)

    def note_hosted(self, mesh_id: str, spawner, class_name: str, actor_id: str, ranks) -> None:
        """An actor mesh was spawned on ``ranks`` of mesh ``mesh_id``, which this process
        owns (``spawner``: the ActorContext that spawned it; None: this process).  A death
        there is then reported as Monarch's are, as that actor's failure.  Any thread."""
        self._hosted.setdefault(mesh_id, []).append((spawner, class_name, actor_id, frozenset(ranks)))

    def forget_hosted(self, mesh_id: str) -> None:
        """Mesh ``mesh_id`` is gone: its actors with it, and its moved ranks' forwards."""
        self._hosted.pop(mesh_id, None)
        self.outbox.forget_mesh(mesh_id)

    def death_failure(self, om: OwnedMesh, rank: int, info: DeathInfo) -> MeshFailure:
        """The supervision event of a death nobody saw.  As in Monarch it names a failed
        actor by its mesh path (one the user spawned there, before the project's own), the
        process's end as the cause; a rank that hosted no actor is named by rank and mesh."""
        here = [h for h in self._hosted.get(om.ref.id, ()) if rank in h[3]]
        pick = next((h for h in here if not h[1].startswith("monarch_kernel.")), here[0] if here else None)
        if pick is None:
            return MeshFailure(om.ref.name, rank, info.describe(), death=info)
        spawner, class_name, actor_id, _ranks = pick
        path = actor_path(spawner, class_name, actor_id, rank, om.ref.dims)
        return MeshFailure(om.ref.name, rank, info.cause(), death=info, actor=path)

    def on_death(self, om: OwnedMesh, rank: int, info: DeathInfo, on_purpose: bool = False) -> None:
        """``rank`` of ``om`` died (the launcher has marked it dead); ``on_purpose``: it was
        killed by ``ProcMesh.kill``, which is no supervision event."""
        observed = self.rank_died(om.ref.id, rank, info) or not om.ready.done()
        for hook in self.hooks.death.all():
            hook(om.ref.id, rank, info)
        body = dumps(info)
        for other in list(self.meshes.values()):
            if other.stopping and (other is om or self.shutting_down()):
                continue  # nobody there will call the dead rank again
            self.outbox.send_tree(other.ref, sorted(other.up & other.alive), Kind.DEATH, body,
                                payload=DeathNotice(om.ref.id))
        if not om.ready.done():
            om.ready.set_exception(ProcessDied(info))
        back = om.restarting.pop(rank, None)
        if back is not None:
            back.set_exception(ProcessDied(info))
        if self.replaces(om, rank, info, on_purpose):
            return
        if not om.stopping and not observed and not on_purpose:
            # A death some call of ours was waiting on has already reached its caller as
            # ProcessDied; only deaths nobody saw become supervision events.
            self.supervise(om, self.death_failure(om, rank, info))

    def replaces(self, om: OwnedMesh, rank: int, info: DeathInfo, on_purpose: bool) -> bool:
        """Under a restart policy of "on-failure", a death within its budget goes to the
        restart hook (and is no supervision event); one past it fails the mesh as a crash
        loop, a supervision event listing every death in the window.  True if handled."""
        budget = om.restart_budget
        hook = self.hooks.restart.current()
        if om.stopping or on_purpose or not budget.policy.on_failure or hook is None:
            return False
        if budget.admit(rank, info):
            hook(om.ref.id, rank, info, True)
            return True
        failure = self.death_failure(om, rank, info)
        failure.text = f"{budget.crash_loop(om.ref.name)}\n{failure.text}"
        hook(om.ref.id, rank, info, False)  # the healer records that it gave up
        self.supervise(om, failure)
        return True

    def on_revive(self, om: OwnedMesh, ranks: list[int]) -> None:
        """Dead ``ranks`` of ``om`` are being started again: this process and every mesh
        told of their deaths forget them (``Kind.REVIVE``)."""
        self.forget_deaths(om.ref.id, ranks)
        for other in list(self.meshes.values()):
            for r in ranks:
                self.outbox.send_tree(other.ref, sorted(other.up & other.alive), Kind.REVIVE,
                                    payload=ReviveNotice(om.ref.id, r))

    def on_moved(self, notices: list[MovedNotice]) -> None:
        """Dead ranks are being started again on other hosts (their own was gone), at new
        addresses: this process sends there from now on (its own copy of their mesh, if it is
        a member, names them there), and so does every live rank of every mesh it spawned,
        since any of them may hold a reference to theirs (``Kind.MOVED``; each passes it on
        to the meshes it spawned in turn).  Sent before the ``REVIVE`` that clears their
        deaths, down the same trees, so no rank calls them at the old address."""
        for n in notices:
            self.outbox.rank_moved(n.mesh, n.rank, n.old, n.new)
            member = self.memberships.get(n.mesh)
            if member is not None:
                ref = member[0].moved(n.rank, n.new, n.host)
                self.memberships[n.mesh] = (ref, member[1])
                if process_mesh[0] is not None and process_mesh[0].id == n.mesh:
                    process_mesh[0] = ref
        for other in list(self.meshes.values()):
            if other.stopping:
                continue
            live = sorted(other.up & other.alive)
            for n in notices:
                self.outbox.send_tree(other.ref, live, Kind.MOVED, payload=n)

    def forget_deaths(self, mesh_id: str, ranks) -> None:
        """This process forgets that ``ranks`` of mesh ``mesh_id`` died: they were started
        again (here, or by the process that owns the mesh: a detached mesh's host)."""
        for r in ranks:
            self.caller.revived(mesh_id, r)

    def supervise(self, om: OwnedMesh, failure: MeshFailure) -> None:
        """Offer the failure to the actor that spawned the proc mesh, else pass it up."""
        self.supervise_by(om.owner_actor, failure)

    def supervise_by(self, owner, failure: MeshFailure) -> None:
        """Offer the failure to ``owner`` (the ActorContext that spawned the failed mesh;
        None: this process itself), else pass it up.  ``__supervise__`` runs on the actor's
        worker between its messages, or while its running async endpoint awaits (which may
        be waiting for this very failure, as in Monarch); an async one on the actor's loop."""
        handler = getattr(owner.instance, "__supervise__", None) if owner is not None else None
        if handler is None:
            self._propagate(failure, owner)
            return

        def decided(handled: bool, error: BaseException | None = None):
            if error is not None:
                failure.chain.append(f"__supervise__ raised {error!r}")
            if not handled:
                self.io.call_soon(self._propagate, failure, owner)

        slot = self.lives.actors.get(owner.actor)
        if inspect.iscoroutinefunction(handler):
            async def run():
                try:
                    decided(bool(await handler(failure)))
                except Exception as e:
                    decided(False, e)

            if slot is not None:  # on the actor's own loop, between messages or in an await
                def go() -> None:
                    if slot.loop is not None and slot.loop.is_running():
                        slot.spawn(run())  # a running endpoint awaits: alongside it
                    else:
                        slot.run(run())

                slot.submit_soon(go)
            else:
                self.io.loop.create_task(run())
        else:
            def run_sync():
                try:
                    decided(bool(handler(failure)))
                except Exception as e:
                    decided(False, e)

            if slot is not None:
                slot.submit_soon(run_sync)
            else:
                run_sync()

    def _propagate(self, failure: MeshFailure, owner) -> None:
        """Up the chain: to this process's own owner (``Kind.FAILURE``), or, at the root, to
        the unhandled-fault hook."""
        if owner is not None:  # named by its mesh path, as the failed actor is
            cls = type(owner.instance)
            failure.chain.append(actor_path(None, f"{cls.__module__}.{cls.__qualname__}", owner.actor, owner.rank,
                                            owner.mesh.dims))
        if self.owner is None:
            self.unhandled(failure)
        else:
            my_mesh = process_mesh[0]
            self.outbox.send_object(self.owner, Kind.FAILURE, my_mesh.id if my_mesh else "", failure)

    def on_failure_report(self, mesh_id: str, failure: MeshFailure) -> None:
        """A rank of a mesh this process spawned reported a failure nobody there handled."""
        om = self.meshes.get(mesh_id)
        if om is not None:
            self.supervise(om, failure)
        else:
            self.unhandled(failure)


def unhandled(hooks: Hooks, failure: MeshFailure) -> None:
    """Give a failure nobody handled to the unhandled hook; a broken hook is reported,
    never allowed to stop the IO thread."""
    try:
        hook = hooks.unhandled.current()
        if hook is not None:  # never None: the point has a default
            hook(failure)
    except Exception as e:  # noqa: BLE001  (the hook is user code; the loop must go on)
        log.error("monarch_kernel: the unhandled-failure hook raised %r", e)
