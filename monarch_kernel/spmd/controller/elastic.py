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
from dataclasses import dataclass, field
from typing import Any

from ...actor.errors import ActorError, MeshStopped, ProcessDied
from ...runtime import Runtime, config, counted, gpus
from ..layout import elastic_layout
from ..rank.elastic import ElasticControl, ElasticRank
from .env import SETUP_TIMEOUT_S, peer_ip

POLL_S = config.seconds("elastic_poll")  # how often elastic_run looks at its ranks' state


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


@dataclass
class _Slot:
    pid: Any
    control: Any
    worker: Any


_slots: dict[str, dict[int, _Slot]] = {}  # mesh id -> rank -> its actors
_slots_lock = threading.Lock()


def elastic_run(procs, fn, *args, min_ranks: int = 1, backend: str | None = None,
                replace_timeout: float = 60.0, group_timeout: float = 300.0, **kwargs) -> ElasticRun:
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
    when the policy gives up, or no replacement comes within ``replace_timeout``) it goes on
    with the ranks left, down to ``min_ranks``.  A rank of ``procs`` that is alive but out of
    the job (restarted by hand, or its host back) joins at the next step boundary.  Each
    time, the group is rebuilt over the same store address and ``fn`` called again on every
    member: ``elastic_steps`` restores from the peers' memory and goes on from the last step
    every rank completed."""
    if min_ranks < 1:
        raise ValueError(f"min_ranks={min_ranks}: at least one rank must train")
    job = _ElasticJob(procs, min_ranks, backend, replace_timeout, group_timeout)
    try:
        return job.run(fn, args, kwargs)
    finally:
        job.close()


class _ElasticJob:
    def __init__(self, procs, min_ranks: int, backend: str | None, replace_timeout: float, group_timeout: float):
        self.procs = procs
        self.flat = procs.flatten("rank")
        self.index = {r: i for i, r in enumerate(procs.shape.ranks)}
        self.min_ranks = min_ranks
        self.backend = backend
        self.replace_timeout = replace_timeout
        self.group_timeout = group_timeout
        with _slots_lock:
            self.slots: dict[int, _Slot] = _slots.setdefault(procs.ref.id, {})  # reused by the next run
        self.members: tuple = ()
        self.deaths: dict[int, tuple[float, str]] = {}  # member -> (monotonic time, how) in this attempt
        self.lock = threading.Lock()
        self.hook = Runtime.current().hooks.death.install(self._on_death) if procs.owned else None

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()

    # ------------------------------------------------------------ the loop

    def run(self, fn, args, kwargs) -> ElasticRun:
        members = self._live()
        self._check_enough(members, "")
        changes: list[Resized] = []
        pending: tuple | None = None  # (kind, ranks, since, cause) of a change not yet in force
        while True:
            with self.lock:
                self.deaths = {}
            try:
                self._form(members)
            except (ActorError, MeshStopped, TimeoutError):
                dead = self._dead_members([])
                if not dead:
                    raise
                since, cause = self._death_words(dead)  # a member died while the group was made: again
                kind, members = self._after_death(dead, cause)
                pending = (kind, dead, pending[2] if pending is not None else since, cause)
                continue
            if pending is not None:
                kind, ranks, since, cause = pending
                change = Resized(kind, tuple(ranks), len(members), time.monotonic() - since, cause)
                changes.append(change)
                print(_describe(self.procs.name, change), flush=True)
                pending = None
            outcome, value = self._attempt(fn, args, kwargs)
            if outcome == "done":
                return ElasticRun(value, changes, members)
            if outcome == "grow":
                since, joining = value
                members = self._live()
                pending = ("grown", joining, since, "")
                continue
            since, cause, dead = value
            kind, members = self._after_death(dead, cause)
            pending = (kind, dead, since, cause)

    def _attempt(self, fn, args, kwargs):
        """Run ``fn`` once on every member: ``("done", values)``, ``("grow", (since, ranks))``
        or ``("died", (since, cause, dead ranks))``."""
        futures = {r: self.slots[r].worker.run.call_one(fn, args, kwargs) for r in self.members}
        left = threading.Semaphore(0)
        for f in futures.values():
            f.then(lambda _f: left.release())  # the IO thread reads the answers: this thread polls
        asked: tuple | None = None
        for _ in futures:
            while not left.acquire(timeout=POLL_S):
                if asked is not None or self.deaths:
                    continue
                joining = [r for r in self._live() if r not in self.members]
                if joining:
                    asked = (time.monotonic(), joining)
                    _all([self.slots[r].control.resize.call_one() for r in self.members])
        values, errors = {}, []
        for r, f in futures.items():
            try:
                values[r] = f.get(timeout=0)
            except (ActorError, MeshStopped) as e:
                errors.append((r, e))
        dead = self._dead_members([r for r, e in errors if isinstance(e, ProcessDied)])
        if dead:
            since, cause = self._death_words(dead)
            return "died", (since, cause, dead)
        if errors:
            raise errors[0][1]
        if any(kind == "resize" for kind, _ in values.values()):
            if asked is None:
                asked = (time.monotonic(), [r for r in self._live() if r not in self.members])
            return "grow", asked
        return "done", {r: v for r, (_, v) in values.items()}

    def _after_death(self, dead: list[int], cause: str) -> tuple[str, tuple]:
        """Wait for the dead ranks' replacements if the mesh's policy replaces them; the
        next members and whether they were replaced or the job shrank."""
        if _replaces(self.procs):
            deadline = time.monotonic() + self.replace_timeout
            while time.monotonic() < deadline:
                if _gave_up(self.procs):
                    break
                if not any(self._is_dead(r) for r in dead):
                    members = self._live()
                    self._check_enough(members, cause)
                    return "replaced", members
                time.sleep(POLL_S)
        members = self._live()
        self._check_enough(members, cause)
        return "shrunk", members

    # ------------------------------------------------------------ the group

    def _form(self, members: tuple) -> None:
        """Place every member, serve the store on the first, and make the group over them."""
        self.members = members  # first: a death from here on is one of theirs
        for r in members:
            self._slot(r)
        hosts = [self.procs.ref.hosts[r] if self.procs.ref.hosts else "" for r in members]
        layout = elastic_layout(members, hosts)
        _all([self.slots[r].control.place.call_one(layout[r]) for r in members])
        spans = len(set(hosts)) > 1
        first = self.slots[members[0]].control
        addr, port = first.rendezvous.call_one(spans, peer_ip(self.procs, members)).get(timeout=SETUP_TIMEOUT_S)
        _all([self.slots[r].control.setup_env.call_one(addr, port) for r in members])
        backend = self.backend or self._backend(members)
        _all([self.slots[r].control.init_process_group.call_one(backend, self.group_timeout) for r in members],
             SETUP_TIMEOUT_S + self.group_timeout)

    def _backend(self, members: tuple) -> str:
        devices = _all([self.slots[r].control.device.call_one() for r in members])
        self.backend = gpus.backend_for(devices)
        return self.backend

    def _slot(self, r: int) -> _Slot:
        """This rank's two actors, spawned again when its process was replaced."""
        pid = self._pids().get(r)
        slot = self.slots.get(r)
        if slot is None or slot.pid != pid:
            one = self.flat.slice(rank=self.index[r])
            slot = self.slots[r] = _Slot(pid, one.spawn("elastic_control", ElasticControl),
                                         one.spawn("elastic_rank", ElasticRank))
        return slot

    def _pids(self) -> dict[int, Any]:
        if not self.procs.owned:
            return {}
        return {row["rank"]: row["pid"] for row in self.procs.rank_states()}

    # ------------------------------------------------------------ deaths

    def _on_death(self, mesh_id: str, rank: int, info) -> None:  # on the IO thread: must not block
        if mesh_id != self.procs.ref.id or rank not in self.members or info.stopped:
            return
        with self.lock:
            self.deaths.setdefault(rank, (time.monotonic(), info.how()))
        survivors = [self.slots[r].control for r in self.members if r != rank and r in self.slots]
        threading.Thread(target=_abort, args=(survivors, f"rank {rank} ({info.how()}) died"),
                         name="elastic-abort", daemon=True).start()

    def _dead_members(self, known: list[int]) -> list[int]:
        """Members that died in this attempt: ``known``, those the death hook heard of (a
        replacement may already stand in a dead rank's place), and those dead now."""
        with self.lock:
            heard = set(self.deaths)
        return sorted(set(known) | heard | {r for r in self.members if self._is_dead(r)})

    def _death_words(self, dead: list[int]) -> tuple[float, str]:
        """When the first of ``dead`` died (monotonic), and how each did."""
        with self.lock:
            deaths = dict(self.deaths)
        since = min((deaths[r][0] for r in dead if r in deaths), default=time.monotonic())
        cause = "; ".join(f"rank {r} {deaths[r][1]}" for r in dead if r in deaths)
        return since, cause or f"ranks {dead} died"

    def _is_dead(self, r: int) -> bool:
        return r in self.procs.dead_ranks()

    def _live(self) -> tuple:
        dead = set(self.procs.dead_ranks())
        return tuple(r for r in self.procs.shape.ranks if r not in dead)

    def _check_enough(self, members: tuple, cause: str) -> None:
        if len(members) < self.min_ranks:
            why = f" ({cause})" if cause else ""
            raise RuntimeError(f"mesh '{self.procs.name}' has {counted(len(members), 'live rank')}{why}, fewer "
                               f"than min_ranks={self.min_ranks}: replace them (procs.restart(), or a restart "
                               "policy: procs.set_restart_policy('on-failure')) and call elastic_run again")


def _abort(controls, reason: str) -> None:
    futures = [c.abort.call_one(reason) for c in controls]
    for f in futures:
        try:
            f.get(timeout=10)
        except (ActorError, MeshStopped, ConnectionError, TimeoutError):
            pass  # that rank is gone too, or busy: its own death or timeout reports it


def _all(futures, timeout: float = SETUP_TIMEOUT_S) -> list:
    return [f.get(timeout=timeout) for f in futures]


def _replaces(procs) -> bool:
    """Whether the mesh's restart policy replaces dead ranks."""
    policy = getattr(procs, "restart_policy", None)
    return getattr(policy, "restart", "never") == "on-failure"


def _gave_up(procs) -> bool:
    events = getattr(procs, "events", None)
    if events is None:
        return False
    got = events()
    return bool(got) and got[-1].kind == "gave-up"


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
