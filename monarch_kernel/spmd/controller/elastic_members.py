"""Who is in an ``elastic_run`` job: each rank's two actors (spawned again on a new process),
the deaths the runtime reports with the generation (the group) each one broke, the ranks
that came back and answered on fresh actors, and the changes from one group to the next.

Runs in the controller, for the job's loop (``elastic.py``).  A rank joins only once its
own fresh actors answered: actors spawned on a process that since died, or on one that is
still being started, are never handed a group to make, which would wait forever.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ...actor.errors import ActorError, MeshStopped
from ...runtime import config
from ..rank.elastic import ElasticControl, ElasticRank

POLL_S = config.seconds("elastic_poll")  # how often elastic_run looks at its ranks' state


@dataclass
class _Slot:
    pid: Any
    control: Any
    worker: Any


_slots: dict[str, dict[int, _Slot]] = {}  # mesh id -> rank -> its actors (reused by the next run)
_dead_pids: dict[str, dict[int, Any]] = {}  # mesh id -> rank -> the pid of its last death seen by a job
_slots_lock = threading.Lock()


class Membership:
    """The ranks of one ``elastic_run`` job over ``procs``: the members of the group being
    made (``generation``), those of the last group made, deaths, and ranks coming back."""

    def __init__(self, procs):
        self.procs = procs
        self.flat = procs.flatten("rank")
        self.index = {r: i for i, r in enumerate(procs.shape.ranks)}
        with _slots_lock:
            self.slots = _slots.setdefault(procs.ref.id, {})
            self.dead_pid = _dead_pids.setdefault(procs.ref.id, {})
        self.lock = threading.Lock()
        self.generation = 0
        self.members: tuple = ()  # of the group being made, or up
        self.formed: tuple = ()  # of the last group made (at first, of the one the job starts to make)
        self.deaths: dict[int, tuple[int, float, str]] = {}  # rank -> (generation, when, how) of its last death
        self.lost: dict[int, tuple[float, str]] = {}  # members that died since ``formed`` was made
        self.probes: dict[int, tuple[Any, Any]] = {}  # rank back -> (its pid, its fresh control's ready())
        self.back: dict[int, float] = {}  # rank back -> when it was first seen so
        self.refused: set = set()  # pids whose probe failed: not asked again

    # ------------------------------------------------------------ generations

    def start(self) -> tuple:
        """The members the job starts with (every live rank): the first group's."""
        self.formed = self.live()
        return self.formed

    def begin(self, members: tuple) -> int:
        """A new group over ``members`` is about to be made: its generation."""
        with self.lock:
            self.generation += 1
            self.members = tuple(members)
            for r in members:
                self.probes.pop(r, None)
            return self.generation

    def made(self) -> list[tuple[str, tuple, float, str]]:
        """The group of the current generation is up: the changes since the last one, as
        ``(kind, ranks, seconds, cause)``, each kind once ("replaced", "shrunk", "grown")."""
        now = time.monotonic()
        with self.lock:
            before, members, lost = set(self.formed), set(self.members), dict(self.lost)
            self.formed, self.lost = self.members, {}
        changes = []
        lost = {r: death for r, death in lost.items() if r in before}  # (a rank that died joining never was in)
        since = min((t for t, _ in lost.values()), default=now)
        cause = "; ".join(f"rank {r} {how}" for r, (_, how) in sorted(lost.items()))
        replaced = tuple(sorted(r for r in lost if r in members))
        shrunk = tuple(sorted(r for r in lost if r not in members))
        grown = tuple(sorted(members - before))
        if replaced:
            changes.append(("replaced", replaced, now - since, cause))
        if shrunk:
            changes.append(("shrunk", shrunk, now - since, cause))
        if grown:
            changes.append(("grown", grown, now - min(self.back.get(r, now) for r in grown), ""))
        for r in members:
            self.back.pop(r, None)
        return changes

    # ------------------------------------------------------------ deaths

    def died(self, rank: int, info) -> tuple[int, list] | None:
        """The death hook's half (on the IO thread: it must not block): remember it; if it
        broke the current group, ``(generation, the other members' controls)`` to abort."""
        with self.lock:
            self.deaths[rank] = (self.generation, time.monotonic(), info.how())
            self.dead_pid[rank] = info.pid
            gen, members = self.generation, self.members
        if rank not in members:
            return None
        return gen, [self.slots[r].control for r in members if r != rank and r in self.slots]

    def dead_members(self, known=()) -> list[int]:
        """Members of the current group that died: ``known``, those the death hook heard of
        in this generation (a replacement may already stand in a dead rank's place), and
        those dead now."""
        with self.lock:
            gen, members = self.generation, self.members
            heard = {r for r, (g, _, _) in self.deaths.items() if g == gen}
        dead = set(self.procs.dead_ranks())
        gone = {r for r in members if r in self.slots and self._stale(r, self.slots[r].pid)}  # and replaced
        return sorted((set(known) | heard | dead | gone) & set(members))

    def wait_for_death(self, grace: float) -> list[int]:
        """A member's failure can reach us before its death does (a peer's socket closed
        first): the dead members, waiting up to ``grace`` s for one."""
        deadline = time.monotonic() + grace
        while True:
            dead = self.dead_members()
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(POLL_S)

    def note_lost(self, dead: list[int]) -> str:
        """``dead`` leave the group: remember when and how; the words for them."""
        now = time.monotonic()
        with self.lock:
            for r in dead:
                _gen, when, how = self.deaths.get(r, (0, now, "died"))
                self.lost.setdefault(r, (when, how))
            return "; ".join(f"rank {r} {self.lost[r][1]}" for r in dead)

    # ------------------------------------------------------------ ranks

    def pids(self) -> dict[int, Any]:
        if not self.procs.owned:
            return {}
        return {row["rank"]: row["pid"] for row in self.procs.rank_states()}

    def live(self) -> tuple:
        """Ranks alive on a process of their own: not dead, and not still being started in a
        dead one's place (its death is forgotten at once, its pid changes once forked)."""
        dead = set(self.procs.dead_ranks())
        pids = self.pids()
        return tuple(r for r in self.procs.shape.ranks if r not in dead and not self._stale(r, pids.get(r)))

    def _stale(self, r: int, pid: Any) -> bool:
        """Whether ``pid`` is that of ``r``'s process that died."""
        return pid is not None and self.dead_pid.get(r) == pid

    def slot(self, r: int, pid: Any = None) -> _Slot:
        """This rank's two actors, spawned again when its process is not the one they were
        spawned on."""
        if pid is None:
            pid = self.pids().get(r)
        slot = self.slots.get(r)
        if slot is None or slot.pid != pid or self._stale(r, pid):
            one = self.flat.slice(rank=self.index[r])
            slot = self.slots[r] = _Slot(pid, one.spawn("elastic_control", ElasticControl),
                                         one.spawn("elastic_rank", ElasticRank))
        return slot

    def ready(self, wait: float = 0.0, ranks=None) -> list[int]:
        """Ranks out of the group that came back and whose fresh actors answered (each new
        process is asked once); waits up to ``wait`` s for those asked (``ranks``: for all of
        these) to answer."""
        deadline = time.monotonic() + wait
        while True:
            self._ask_new()
            ready, asking = [], []
            for r, (pid, f) in list(self.probes.items()):
                if not f.done():
                    asking.append(r)
                    continue
                try:
                    f.get(timeout=0)
                except (ActorError, MeshStopped):
                    del self.probes[r]  # died again, or cannot import torch: not this process again
                    self.refused.add(pid)
                    continue
                ready.append(r)
            done = set(ranks) <= set(ready) if ranks is not None else (ready or not asking)
            if done or time.monotonic() >= deadline:
                return sorted(ready)
            time.sleep(POLL_S)

    def _ask_new(self) -> None:
        with self.lock:
            staying = set(self.members) - set(self.lost)
        pids = self.pids()
        for r in self.live():
            if r in staying or r in self.probes or (pids.get(r) is not None and pids[r] in self.refused):
                continue
            slot = self.slot(r, pids.get(r))
            probe = slot.control.ready.call_one()
            probe.then(_read_by_io)  # polled with done(), between sleeps: nobody blocks on its answer
            self.probes[r] = (pids.get(r), probe)
            self.back.setdefault(r, time.monotonic())


def _read_by_io(_answered) -> None:
    """A probe's ``then``: its answer is read by the IO thread, as nobody waits on it."""
