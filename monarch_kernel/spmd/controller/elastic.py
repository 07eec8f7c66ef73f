"""``elastic_run(procs, train, ...)``: a training function run on every rank of a mesh that
outlives its ranks.  When a rank dies the controller waits for its replacement (the mesh's
restart policy) or, when none comes, goes on with the ranks it has; when a rank comes back
it grows again at the next step boundary.  Each time the group is rebuilt over the same
processes and the function called again; it resumes from peers' memory (``elastic_steps``).

Runs in the controller; the ranks' half is ``rank/elastic.py``.  It never imports torch,
and never touches the ranks' notebook namespaces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ...actor.errors import ActorError, HangError, MeshStopped, ProcessDied
from ...runtime import Runtime, config, counted, gpus
from ..layout import elastic_layout
from .elastic_members import POLL_S, Membership
from .env import SETUP_TIMEOUT_S, peer_ip

GROUP_POLL_S = config.seconds("elastic_group_poll")  # each member waits this long for its group, between looks
DEATH_GRACE_S = config.seconds("elastic_death_grace")  # a member's failure waits for a death that explains it
JOIN_WAIT_S = config.seconds("elastic_join_wait")  # the next group waits for a rank back still starting
RENDEZVOUS_S = config.seconds("elastic_rendezvous")  # a group not made by then is aborted, and the run fails


@dataclass(frozen=True)
class Resized:
    """One change of the job's membership: ``kind`` is ``"replaced"`` (a dead rank's
    replacement joined), ``"shrunk"`` (it went on without the dead ranks) or ``"grown"``
    (ranks came back); ``ranks`` the ranks that left or joined; ``seconds`` from the death
    (or from seeing the ranks back) to the new group being up.

    Example::

        run = elastic_run(procs, train, steps=100)
        for change in run.changes:
            print(change.kind, change.ranks, f"{change.seconds:.2f} s")
    """

    kind: str
    ranks: tuple
    world_size: int
    seconds: float
    cause: str = ""


@dataclass
class ElasticRun:
    """What ``elastic_run`` returns: each final member's return value (by proc-mesh rank),
    the membership changes on the way, and the final members.

    Example::

        run = elastic_run(procs, train, steps=100)
        run.values[0]     # rank 0's return value (e.g. its last loss)
        run.members       # the ranks that finished
    """

    values: dict[int, Any]
    changes: list[Resized] = field(default_factory=list)
    members: tuple = ()


def elastic_run(procs, fn, *args, min_ranks: int = 1, backend: str | None = None,
                replace_timeout: float = 60.0, group_timeout: float = 300.0, rendezvous_timeout: float | None = None,
                on_rebuild: Callable[[str, int, tuple], None] | None = None, **kwargs) -> ElasticRun:
    """Run ``fn(*args, **kwargs)`` on every live rank of ``procs`` over a fresh process
    group, and keep it running through deaths::

        def train(steps):                       # runs on the ranks
            model, opt = MLP(), torch.optim.Adam(...)
            ddp = DistributedDataParallel(model)
            for step in elastic_steps(steps, model, opt):
                ...
            return loss.item()

        run = elastic_run(procs, train, 250)    # in the notebook
        run.values                              # {rank: loss}

    A rank dies: the others' group is aborted at once; under a restart policy
    (``procs.set_restart_policy("on-failure")``) the job waits for the replacement, else (or
    when the policy gives up or cannot replace it, or none comes within ``replace_timeout``) it goes on
    with the ranks left, down to ``min_ranks``.  A rank of ``procs`` that is alive but out of
    the job (restarted by hand, or its host back) joins at the next step boundary once it
    answers; one back before the group without it was made joins that group.  Each time,
    the group is rebuilt over the same store address and ``fn`` called again on every
    member: ``elastic_steps`` restores from the peers' memory and goes on from the last step
    every rank completed.  A member that dies while a group is being made aborts that
    rendezvous on the others at once, and the group is made again without it.

    Nothing waits on a member that failed without dying: when ``fn`` raises on one member,
    the group is aborted on the others at once (their collectives fail now, not at
    ``group_timeout``, torch's timeout for each collective) and its error is raised; a group
    whose members have not all made it within ``rendezvous_timeout`` s (default: the
    ``elastic_rendezvous`` setting, 60 s) is aborted and a ``TimeoutError`` raised, saying where
    each member's threads are.  Under the hang watchdog (``then="abort"``) it raises the
    watchdog's ``HangError``, the group aborted on every member.

    ``on_rebuild(stage, generation, members)``, if given, is called in this thread as the
    job changes: ``"lost"`` when members of the group of ``generation`` died (before the
    next members are chosen), ``"placed"`` when a group's members are placed and its store
    served, and ``"making"`` once they were all asked to make it (their rendezvous under
    way).  It holds the rebuild while it runs (tests make a rank come back, or die, there)."""
    if min_ranks < 1:
        raise ValueError(f"min_ranks={min_ranks}: at least one rank must train")
    job = _ElasticJob(procs, min_ranks, backend, replace_timeout, group_timeout, on_rebuild,
                      RENDEZVOUS_S if rendezvous_timeout is None else rendezvous_timeout)
    try:
        return job.run(fn, args, kwargs)
    finally:
        job.close()


class _ElasticJob:
    def __init__(self, procs, min_ranks: int, backend: str | None, replace_timeout: float, group_timeout: float,
                 on_rebuild, rendezvous_timeout: float):
        self.procs = procs
        self.min_ranks = min_ranks
        self.backend = backend
        self.replace_timeout = replace_timeout
        self._formed_at = 0.0  # when the current group began to be made (a death after it is this group's)
        self.group_timeout = group_timeout
        self.rendezvous_timeout = rendezvous_timeout
        self.on_rebuild = on_rebuild
        self.ms = Membership(procs)
        self.hook = Runtime.current().hooks.death.install(self._on_death) if procs.owned else None

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()

    # ------------------------------------------------------------ the loop

    def run(self, fn, args, kwargs) -> ElasticRun:
        try:
            return self._run(fn, args, kwargs)
        except HangError as e:  # the watchdog's (then="abort"): the job's group goes too, the mesh stays
            self._abort_group(self.ms.members, self.ms.generation,
                              f"the hang watchdog found no progress on ranks {e.ranks}")
            raise

    def _run(self, fn, args, kwargs) -> ElasticRun:
        members = self.ms.start()
        self._check_enough(members, "")
        changes: list[Resized] = []
        while True:
            try:
                self._form(members)
            except (ActorError, MeshStopped, TimeoutError, _MemberDied) as e:
                dead = self.ms.wait_for_death(DEATH_GRACE_S)
                if not dead and isinstance(e, TimeoutError) and not isinstance(e, _Wedged):
                    raise TimeoutError(f"{e}; elastic_run was making the group of {members}, where the ranks' "
                                       f"threads are:\n{_where(self.procs, members)}") from e
                if not dead:
                    raise
                members = self._after_death(dead)  # a member died while the group was made: again
                continue
            for kind, ranks, seconds, cause in self.ms.made():
                change = Resized(kind, ranks, len(members), seconds, cause)
                changes.append(change)
                print(_describe(self.procs.name, change), flush=True)
            outcome, value = self._attempt(fn, args, kwargs)
            if outcome == "done":
                return ElasticRun(value, changes, members)
            if outcome == "grow":
                members = tuple(sorted(set(members) | set(value)))
                continue
            members = self._after_death(value)

    def _attempt(self, fn, args, kwargs):
        """Run ``fn`` once on every member: ``("done", values)``, ``("grow", ranks ready to
        join)`` or ``("died", dead ranks)``."""
        gen, members = self.ms.generation, self.ms.members
        futures = {r: self.ms.slots[r].worker.run.call_one(fn, args, kwargs, gen) for r in members}
        asked = broken = False
        self._failed_first: int | None = None
        while waiting := [f for f in futures.values() if not f.done()]:
            try:  # waited for as any call is: the hang watchdog's HangError (then="abort") lands here
                waiting[0].get(timeout=POLL_S)
            except (TimeoutError, ActorError, MeshStopped):
                pass  # still running, or its failure: read below
            if not broken:
                broken = self._abort_if_failed(futures, gen, fn)
            if asked or broken or self.ms.dead_members():
                continue
            if self.ms.ready():  # a rank back, its actors answering: all leave at the next step boundary
                asked = True
                for r in members:  # not waited for: the ranks agree among themselves
                    self.ms.slots[r].control.resize.call_one(gen)
        if not broken:
            broken = self._abort_if_failed(futures, gen, fn)
        values, errors = {}, []
        for r, f in futures.items():
            try:
                values[r] = f.get(timeout=0)
            except (ActorError, MeshStopped) as e:
                errors.append((r, e))
        dead = self.ms.dead_members([r for r, e in errors if isinstance(e, ProcessDied)])
        if errors and not dead:
            dead = self.ms.wait_for_death(DEATH_GRACE_S)
        if dead:
            return "died", dead
        if errors:  # the member that failed first (the others' errors may be the abort's)
            raise dict(errors).get(self._failed_first, errors[0][1])
        if any(kind == "resize" for kind, _ in values.values()):
            return "grow", self.ms.ready()
        return "done", {r: v for r, (_, v) in values.items()}

    def _abort_if_failed(self, futures: dict, gen: int, fn) -> bool:
        """A member's call failed: unless a death explains it (its hook aborts the group), the
        group is aborted on every member: those still running would otherwise wait for it in
        their collectives until torch's timeout (``group_timeout``).  True once aborted, or a
        death seen."""
        failed = [r for r, f in futures.items() if f.done() and f.exception(timeout=0) is not None]
        if not failed:
            return False
        if self.ms.wait_for_death(DEATH_GRACE_S):
            return True
        r = failed[0]
        error = futures[r].exception(timeout=0)
        failure = getattr(error, "failure", None)  # an ActorError: what the rank raised
        what = f"{failure.type_name}: {failure.message}" if failure is not None else f"{type(error).__name__}"
        reason = f"rank {r}'s {getattr(fn, '__name__', 'function')} raised {what.splitlines()[0][:200]}"
        self._failed_first = r
        self._abort_group(tuple(futures), gen, reason)
        return True

    def _abort_group(self, members: tuple, gen: int, reason: str) -> None:
        """Abort the group of ``gen`` on every one of ``members`` (not waited for: a stuck
        member never answers), so that no collective of this job waits on after it."""
        controls = [self.ms.slots[r].control for r in members if r in self.ms.slots]
        threading.Thread(target=_abort, args=(controls, reason, gen), name="elastic-abort", daemon=True).start()

    def _after_death(self, dead: list[int]) -> tuple:
        """The next members after ``dead`` left the group: the survivors' group is aborted
        first (before anything of the next is sent them); the dead ranks' replacements are
        waited for if the mesh's policy replaces them; ranks back and answering join."""
        gen, members = self.ms.generation, self.ms.members
        cause = self.ms.note_lost(dead)
        survivors = tuple(r for r in members if r not in dead)
        for r in survivors:  # this thread's messages reach each rank in order: before its next place()
            self.ms.slots[r].control.abort.call_one(f"{cause}: the group is made again", gen)
        if self.on_rebuild is not None:
            self.on_rebuild("lost", gen, members)
        if _replaces(self.procs):
            deadline = time.monotonic() + self.replace_timeout
            while time.monotonic() < deadline and not _gave_up(self.procs, dead, self._formed_at):
                back = self.ms.ready(min(POLL_S * 10, max(0.0, deadline - time.monotonic())), ranks=dead)
                if set(dead) <= set(back):
                    break
        back = self.ms.ready(JOIN_WAIT_S)  # a rank back but still starting is waited for a little
        members = tuple(sorted(set(survivors) | set(back)))
        self._check_enough(members, cause)
        return members

    # ------------------------------------------------------------ the group

    def _form(self, members: tuple) -> None:
        """Place every member, serve the store on the first, and make the group over them,
        within ``rendezvous_timeout`` once torch is imported on every member."""
        self._formed_at = time.time()
        for r in members:
            self.ms.slot(r)
        gen = self.ms.begin(members)  # from here a death of one of them aborts this generation
        slots = self.ms.slots
        hosts = [self.procs.ref.hosts[r] if self.procs.ref.hosts else "" for r in members]
        layout = elastic_layout(members, hosts)
        # A member may first wait for its last group's maker to give up (within rendezvous_timeout).
        _all([slots[r].control.place.call_one(layout[r], gen) for r in members],
             SETUP_TIMEOUT_S + self.rendezvous_timeout)
        # torch.distributed imported first (a cold rank may take long): the rendezvous is timed without it.
        _all([slots[r].control.ready.call_one() for r in members], SETUP_TIMEOUT_S + self.group_timeout)
        spans = len(set(hosts)) > 1
        first = slots[members[0]].control
        addr, port = first.rendezvous.call_one(spans, peer_ip(self.procs, members)).get(timeout=SETUP_TIMEOUT_S)
        _all([slots[r].control.setup_env.call_one(addr, port) for r in members])
        if self.on_rebuild is not None:
            self.on_rebuild("placed", gen, members)
        backend = self.backend or self._backend(members)
        if self.ms.dead_members():  # none starts a rendezvous that a dead member would never join
            raise _MemberDied(f"a member died before the group of generation {gen} was made")
        _all([slots[r].control.make_group.call_one(backend, self.group_timeout, gen, self.rendezvous_timeout)
              for r in members])
        if self.on_rebuild is not None:
            self.on_rebuild("making", gen, members)
        deadline = time.monotonic() + self.rendezvous_timeout
        waiting = list(members)
        while waiting:  # asked again and again, so that a member's death is seen within a poll
            if self.ms.dead_members():
                raise _MemberDied(f"a member died while the group of generation {gen} was made")
            left = deadline - time.monotonic()
            if left <= 0:
                self._wedged(gen, members, f"ranks {waiting} did not finish")
            polls = {r: slots[r].control.group_made.call_one(gen, min(GROUP_POLL_S, left)) for r in waiting}
            silent, still = [], []
            for r, f in polls.items():
                try:
                    if f.get(timeout=max(0.0, deadline - time.monotonic()) + GROUP_POLL_S) is None:
                        still.append(r)
                except TimeoutError:
                    silent.append(r)  # its actor does not answer (a stopped process, or one stuck holding the GIL)
            if silent:
                if self.ms.dead_members():
                    raise _MemberDied(f"a member died while the group of generation {gen} was made")
                self._wedged(gen, members, f"ranks {silent} did not answer (a stopped process, or one stuck "
                             "holding the GIL)" + (f", ranks {still} were still making it" if still else ""))
            waiting = still

    def _wedged(self, gen: int, members: tuple, who: str) -> NoReturn:
        """The group was not made within ``rendezvous_timeout``: where every member is, then
        the rendezvous aborted on all (their makers end, the store closes; not waited for, a
        silent member never answers), and ``_Wedged`` raised."""
        where = _where(self.procs, members)  # before the abort moves them on
        reason = f"the group of generation {gen} was not made within {self.rendezvous_timeout:g} s"
        self._abort_group(members, gen, reason)
        raise _Wedged(f"the process group of {counted(len(members), 'rank')} was not made within "
                      f"{self.rendezvous_timeout:g} s (elastic_run's rendezvous_timeout): {who}; it was aborted "
                      f"on every member; where their threads were:\n{where}")

    def _backend(self, members: tuple) -> str:
        devices = _all([self.ms.slots[r].control.device.call_one() for r in members])
        self.backend = gpus.backend_for(devices)
        return self.backend

    # ------------------------------------------------------------ deaths

    def _on_death(self, mesh_id: str, rank: int, info) -> None:  # on the IO thread: must not block
        if mesh_id != self.procs.ref.id or info.stopped:
            return
        broken = self.ms.died(rank, info)
        if broken is not None:
            gen, survivors = broken
            threading.Thread(target=_abort, args=(survivors, f"rank {rank} ({info.how()}) died", gen),
                             name="elastic-abort", daemon=True).start()

    def _check_enough(self, members: tuple, cause: str) -> None:
        if len(members) < self.min_ranks:
            why = f" ({cause})" if cause else ""
            raise RuntimeError(f"mesh '{self.procs.name}' has {counted(len(members), 'live rank')}{why}, fewer "
                               f"than min_ranks={self.min_ranks}: replace them (procs.restart(), or a restart "
                               "policy: procs.set_restart_policy('on-failure')) and call elastic_run again")


class _MemberDied(Exception):
    """A member died while its group was made (the loop makes it again without it)."""


class _Wedged(TimeoutError):
    """The members did not make their group within ``rendezvous_timeout`` (it was aborted)."""


def _abort(controls, reason: str, generation: int) -> None:
    """Abort the group on every member still there.  The mesh may be stopped meanwhile (the
    user's ``stop``, or a test's teardown): then sending fails as the answer would, and is
    ignored the same way."""
    futures = []
    for c in controls:
        try:
            futures.append(c.abort.call_one(reason, generation))
        except (MeshStopped, ConnectionError):
            pass  # stopped, or that rank is gone: nothing is left to abort there
    for f in futures:
        try:
            f.get(timeout=10)
        except (ActorError, MeshStopped, ConnectionError, TimeoutError):
            pass  # that rank is gone too, or busy: its own death or timeout reports it


def _where(procs, members: tuple) -> str:
    """Every thread's stack on ``members`` (runtime frames too: the group is made there), for
    a rebuild that timed out."""
    try:
        return repr(procs.stacks([procs.shape.ranks.index(r) for r in members], all_threads=True,
                                 runtime_frames=True, timeout=10.0))
    except HangError:  # the watchdog's, for this thread: it ends the job
        raise
    except Exception as e:  # noqa: BLE001 - the timeout is still raised, without them
        return f"(not read: {e!r})"


def _all(futures, timeout: float = SETUP_TIMEOUT_S) -> list:
    return [f.get(timeout=timeout) for f in futures]


def _replaces(procs) -> bool:
    """Whether the mesh's restart policy replaces dead ranks."""
    policy = getattr(procs, "restart_policy", None)
    return getattr(policy, "restart", "never") == "on-failure"


def _gave_up(procs, dead, since: float) -> bool:
    """Whether the policy will not bring ``dead`` back now: it gave up on the mesh (a crash
    loop), or a restart of one of them, for a death after ``since``, failed (its host is gone
    and no other has room).  The job then goes on without them, and grows back if one returns."""
    events = getattr(procs, "events", None)
    if events is None:
        return False
    got = events()
    if got and got[-1].kind == "gave-up":
        return True
    return any(e.kind == "failed" and set(e.ranks) & set(dead) and e.died_at >= since for e in got)


def _describe(mesh: str, c: Resized) -> str:
    ranks = ",".join(str(r) for r in c.ranks)
    why = f" ({c.cause})" if c.cause else ""
    if c.kind == "replaced":
        what = f"rank {ranks} replaced{why}"
    elif c.kind == "shrunk":
        what = f"went on without rank {ranks}{why}"
    else:
        what = f"rank {ranks} joined"
    return f"elastic_run on '{mesh}': {what}; {counted(c.world_size, 'rank')} from here, {c.seconds:.1f} s later"
