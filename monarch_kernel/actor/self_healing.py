"""The healer: replaces the dead ranks of a mesh whose restart policy is "on-failure", spawns
its actors there again with the arguments they were spawned with, tells every actor of the
mesh (``__on_restart__``), re-sends the calls of ``@endpoint(retries=N)`` endpoints, and
records each restart as a ``RestartEvent``.

The runtime decides (``runtime/spawn/restart_policy.py``: within the budget, or a crash
loop) and calls ``hooks.restart`` on its IO thread; the work happens here, on one thread
per mesh, so that the IO thread never waits for a rank to start.  Only the process that
spawned a mesh heals it.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..runtime import RESTART_HOOK, Completion, DeathInfo, RestartPolicy, Runtime, Status, config, dumps
from .restart_event import RestartEvent

log = logging.getLogger("monarch_kernel.actor")

RESTART_TIMEOUT_S = config.seconds("restart_timeout")  # a replacement's actors not built by then: it failed
IDLE_EXIT_S = config.seconds("restart_idle")  # a healer's thread ends after this long without a death, policy off
WARM_EVERY_S = config.seconds("restart_warm_every")  # how often the standby template is kept up to date

_healers: dict[str, Healer] = {}  # mesh id -> its healer (meshes this process spawned)
_listeners: list[Callable[[RestartEvent], None]] = []


@dataclass
class _Death:
    rank: int
    info: DeathInfo
    at: float
    replace: bool
    reason: str = "died"


class Listening:
    """What ``on_event`` returns: ``remove()`` stops the listener."""

    def __init__(self, fn):
        self._fn = fn

    def remove(self) -> None:
        if self._fn in _listeners:
            _listeners.remove(self._fn)


def on_event(fn: Callable[[RestartEvent], None]) -> Listening:
    """Call ``fn(event)`` for every ``RestartEvent`` of every mesh (on the healer's thread;
    it must not block long): the kernel's cell line, panel and history listen here."""
    _listeners.append(fn)
    return Listening(fn)


def healer_of(procs) -> Healer:
    """The healer of ``procs``'s mesh (made on first use; ``procs`` must be owned here)."""
    h = _healers.get(procs.ref.id)
    if h is None:
        from .proc_mesh import whole_mesh

        h = _healers[procs.ref.id] = Healer(whole_mesh(procs))
        rt = Runtime.current()
        if not rt.hooks.restart.has(_on_restart):
            rt.hooks.restart.install(_on_restart)
    return h


def existing(mesh_id: str) -> Healer | None:
    return _healers.get(mesh_id)


def forget(mesh_id: str) -> None:
    """The mesh was stopped: its healer (and the actors' arguments it kept) go."""
    h = _healers.pop(mesh_id, None)
    if h is not None:
        h.close()


def _on_restart(mesh_id: str, rank: int, info: DeathInfo, replace: bool) -> None:
    """``hooks.restart``, on the IO thread: queue the death for the mesh's healer."""
    h = _healers.get(mesh_id)
    if h is not None:
        h.died(rank, info, replace)


class Healer:
    """One mesh's healer.  ``died`` runs on the IO thread; the rest on the healer's thread
    or the caller's."""

    def __init__(self, procs):
        self.procs = procs  # the whole ProcMesh
        self.actors: list[tuple] = []  # (ActorMesh, cls, args, kwargs), in spawn order
        self.events: list[RestartEvent] = []
        self._told = 0  # the last event whose listeners have been told (``wait_restart`` returns no later one)
        self._cond = threading.Condition()
        self._queue: list[_Death] = []
        self._thread: threading.Thread | None = None
        self._waiters: list[tuple[int, Callable[[bool], None]]] = []  # (rank, fn(replaced?))
        self._pending: dict[int, set[int]] = {}  # rank -> pids of its dead processes not yet replaced
        self._outcome: dict[int, bool] = {}  # pid of a dead process -> whether its rank was replaced
        self._closed = False

    # ------------------------------------------------------------ what it is told

    @property
    def policy(self) -> RestartPolicy:
        return self.procs.restart_policy

    def note_spawned(self, mesh, cls, args, kwargs) -> None:
        """An actor mesh was spawned on the mesh: a replacement gets it again, so."""
        with self._cond:
            self.actors.append((mesh, cls, args, kwargs))

    def died(self, rank: int, info: DeathInfo, replace: bool, reason: str = "died") -> None:
        """Queue a death (``replace`` False: past the budget, record that it gave up)."""
        with self._cond:
            self._queue.append(_Death(rank, info, time.time(), replace, reason))
            self._pending.setdefault(rank, set()).add(info.pid)
        self.start()

    def replace_hung(self, ranks: list[int], timeout: float = 10) -> list[int]:
        """The watchdog's ``then="restart"``: SIGKILL ``ranks`` and replace them under the
        policy (each counted in its budget).  Returns the ranks queued for replacement."""
        budget = self.procs.restart_budget
        self.procs.kill(ranks, timeout)
        rt = Runtime.current()
        queued = []
        for r in ranks:
            info = rt.death(self.procs.ref.id, r)
            if info is None:
                continue
            within = budget.admit(r, info)
            self.died(r, info, within, reason="hung")
            if within:
                queued.append(r)
        return queued

    def after_replaced(self, ranks: list[int], pids: list[int], fn: Callable[[bool], None]) -> None:
        """Call ``fn(True)`` once every rank of ``ranks`` (whose dead processes had ``pids``)
        has been replaced, ``fn(False)`` if the policy gave up first."""
        done: list[bool] = []  # once fn was called

        def one(rank: int, ok: bool) -> None:
            if done:
                return
            left.discard(rank)
            if not ok or not left:
                done.append(ok)
                fn(ok)

        with self._cond:  # a death already settled (the call ended after its restart) is not waited for
            known = [self._outcome[pid] for pid in pids if pid in self._outcome]
            left = {r for r, pid in zip(ranks, pids, strict=True) if pid not in self._outcome}
            if left and all(known):
                for r in sorted(left):
                    self._waiters.append((r, functools.partial(one, r)))
                return
        fn(all(known))

    def wait_restart(self, after: int = 0, timeout: float = 60) -> RestartEvent:
        """The first event numbered past ``after``, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                later = [e for e in self.events if after < e.index <= self._told]
                if later:
                    return later[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for a restart of mesh "
                                       f"'{self.procs.name}' (events so far: {len(self.events)})")
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._settle(None, False)

    # ------------------------------------------------------------ its thread

    def start(self) -> None:
        """Run the healer's thread (it keeps the standby template warm while the policy is on)."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"healer-{self.procs.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        warmed = 0.0
        while True:
            if self.procs.stopped_here():  # stopped another way than its ProcMesh.stop (a job's end)
                forget(self.procs.ref.id)
                with self._cond:
                    self._thread = None
                return
            on = self.policy.on_failure
            if on and time.monotonic() - warmed >= WARM_EVERY_S:
                warmed = time.monotonic()
                self._keep_warm()
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(WARM_EVERY_S if on else IDLE_EXIT_S)
                if self._closed or (not self._queue and not self.policy.on_failure):
                    self._thread = None
                    return
                batch, self._queue = self._queue, []
            if not batch:
                continue
            try:
                self._handle(batch)
            except Exception as e:  # noqa: BLE001  (the thread must go on healing the next death)
                log.error("monarch_kernel: healing mesh '%s' failed: %r", self.procs.name, e)
            warmed = 0.0  # the replacement may have changed what the ranks hold

    def _keep_warm(self) -> None:
        try:
            self.procs.warm_standby()
        except Exception as e:  # noqa: BLE001  (a cold replacement still works: only slower)
            log.warning("monarch_kernel: could not warm the standby template of mesh '%s': %r", self.procs.name, e)

    def _handle(self, batch: list[_Death]) -> None:
        for d in [d for d in batch if not d.replace]:
            self._gave_up(d)
        todo = [d for d in batch if d.replace and not self.procs.stopped_here()]
        if not todo:
            return
        ranks = sorted({d.rank for d in todo})
        with self._cond:
            actors = list(self.actors)
        was = self.procs.ref  # a rank whose host is gone moves: its address changes
        try:
            self.procs.restart(ranks, [(m, c, a, k) for m, c, a, k in actors if not m.actors_stopped()],
                               RESTART_TIMEOUT_S, kill_unresponsive=False)
        except Exception as e:  # noqa: BLE001  (a replacement that died again is queued again by its death)
            self._record(RestartEvent(mesh=self.procs.name, kind="failed", ranks=tuple(ranks),
                                      causes=tuple(next(d.info.how() for d in todo if d.rank == r) for r in ranks),
                                      reason="hung" if any(d.reason == "hung" for d in todo) else "died",
                                      died_at=min(d.at for d in todo), at=time.time(),
                                      restarts=len(self.procs.restart_budget.in_window()), error=str(e)))
            with self._cond:
                again = {d.rank for d in self._queue}  # replacements that died in turn: healed next
            self._settle(set(ranks) - again, False)
            return
        rows = {row["rank"]: row for row in self.procs.rank_states()}
        budget = self.procs.restart_budget
        event = RestartEvent(
            mesh=self.procs.name, kind="restart", ranks=tuple(ranks),
            causes=tuple(next(d.info.how() for d in todo if d.rank == r) for r in ranks),
            reason="hung" if any(d.reason == "hung" for d in todo) else "died",
            hosts=tuple(rows[r]["host"] for r in ranks), pids=tuple(rows[r]["pid"] for r in ranks),
            died_at=min(d.at for d in todo), at=time.time(), restarts=len(budget.in_window()),
            moved_from=tuple(was.hosts[r] if was.addresses[r] != self.procs.ref.addresses[r] else "" for r in ranks))
        self._record(event)
        self._tell_actors(event, actors)
        self._settle(set(ranks), True)

    def _gave_up(self, d: _Death) -> None:
        budget = self.procs.restart_budget
        event = RestartEvent(mesh=self.procs.name, kind="gave-up", ranks=(d.rank,), causes=(d.info.how(),),
                             reason=d.reason, died_at=d.at, at=time.time(), restarts=len(budget.in_window()),
                             deaths=tuple((x.at, x.rank, x.cause) for x in budget.in_window()))
        self._record(event)
        self._settle(None, False)

    def _record(self, event: RestartEvent) -> None:
        """Listed in ``events`` first (whoever saw its line and asks finds it there), then the
        listeners told (the kernel's line in the cell), then whoever waits for it: a cell that
        waits for the restart shows its line before it ends."""
        with self._cond:
            event = replace(event, index=len(self.events) + 1)
            self.events.append(event)
        for fn in list(_listeners):
            try:
                fn(event)
            except Exception as e:  # noqa: BLE001  (a listener is the kernel's or the user's)
                log.error("monarch_kernel: a restart listener raised %r", e)
        with self._cond:
            self._told = event.index
            self._cond.notify_all()

    def _settle(self, ranks: set[int] | None, ok: bool) -> None:
        """The deaths of ``ranks`` (all, when None) were replaced (``ok``) or will not be: so
        recorded, and their waiters told."""
        with self._cond:
            for r in list(self._pending) if ranks is None else ranks:
                for pid in self._pending.pop(r, ()):
                    self._outcome[pid] = ok
            hit = [(r, fn) for r, fn in self._waiters if ranks is None or r in ranks]
            self._waiters = [(r, fn) for r, fn in self._waiters if not (ranks is None or r in ranks)]
        for _r, fn in hit:
            fn(ok)

    def _tell_actors(self, event: RestartEvent, actors) -> None:
        """Send ``__on_restart__(event)`` to every rank of each actor mesh whose class has it,
        without waiting (a survivor may be blocked in a collective with the dead rank); a
        hook that raises is printed."""
        rt = Runtime.current()
        body = dumps(((event,), {}))
        for mesh, cls, _args, _kwargs in actors:
            if getattr(cls, RESTART_HOOK, None) is None or mesh.actors_stopped():
                continue
            ranks = [r for r in mesh._shape.ranks if rt.death(mesh._proc_ref.id, r) is None]
            pending = rt.call(mesh._proc_ref, mesh._actor_id, RESTART_HOOK, ranks, body, callbacks=True)

            def report(c, name=mesh._name):
                for r, part in c.result().items():
                    if part.status == Status.RAISED:
                        failure = part.load()
                        print(f"[{self.procs.name}] rank {r}: {name}.__on_restart__ raised {failure.type_name}: "
                              f"{failure.message}", file=sys.stderr, flush=True)

            pending.completion.add_done_callback(report)


def retried(mesh_id: str, ranks: list[int], retries: int, send: Callable[[list[int]], object]) -> Completion:
    """A call of an ``@endpoint(retries=N)`` endpoint: ``send(ranks)`` sends it (a
    PendingCall whose replies the IO thread reads); a rank that dies meanwhile gets the call
    again once its replacement is up, at most ``retries`` times (-1: as long as the policy
    restarts it).  The completion holds every rank's last part."""
    out = Completion()
    parts: dict = {}

    def attempt(rs: list[int], left: int) -> None:
        try:
            pending = send(rs)
        except BaseException as e:  # noqa: BLE001  (the caller hears it from the completion)
            out.set_exception(e)
            return

        def done(c) -> None:
            try:
                got = c.result()
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
                return
            parts.update(got)
            died = sorted(r for r, p in got.items() if p.status == Status.DIED)
            h = _healers.get(mesh_id)
            if not died or left == 0 or h is None or not h.policy.on_failure:
                out.set_result(dict(parts))
                return
            pids = [got[r].load().pid for r in died]

            def replaced(ok: bool) -> None:
                if ok:
                    attempt(died, left - 1)
                else:
                    out.set_result(dict(parts))

            h.after_replaced(died, pids, replaced)

        pending.completion.add_done_callback(done)  # type: ignore[attr-defined]

    attempt(list(ranks), retries)
    return out
