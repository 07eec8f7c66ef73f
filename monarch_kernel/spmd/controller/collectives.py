"""``collectives(procs)`` and ``%mesh collectives``: where each rank is in its process
groups' collectives, and which rank holds the others up.

Each rank's flight recorder (``rank/flight.py``) says, per group, the last collective it
entered and the last it finished.  Ranks inside the newest collective wait for the ones
that never entered it; those are named, with where they are (their stacks).  Runs in the
controller; the ranks answer through the mesh's ``ElasticEnvActor``, a thread of its own
that is free while user code blocks in a collective.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ...runtime import config, rank_label
from .env import record

ASK_S = config.seconds("collectives_ask")


@dataclass
class GroupState:
    """One process group across the ranks that answered."""

    name: str
    entered: dict[int, int] = field(default_factory=dict)  # rank -> last collective it entered
    finished: dict[int, int] = field(default_factory=dict)  # rank -> last it finished
    ops: dict[int, dict] = field(default_factory=dict)  # seq -> an entry for it (op, sizes, dtype, started)

    def newest(self) -> int:
        return max(self.entered.values(), default=-1)

    def waiting(self) -> list[int]:
        """Ranks inside the newest collective, not finished."""
        n = self.newest()
        return sorted(r for r, e in self.entered.items() if e == n and self.finished.get(r, -1) < n)

    def behind(self) -> list[int]:
        """Ranks that have not entered the newest collective: the others wait for them."""
        n = self.newest()
        return sorted(r for r, e in self.entered.items() if e < n) if self.waiting() else []


class CollectivesReport:
    """Per group, where each rank is; ``holding_up()``: the ranks the others wait for.

    Example::

        report = collectives(procs)
        print(report)
        report.holding_up()                  # e.g. [3]
    """

    def __init__(self, mesh: str, groups: list[GroupState], silent: list[int], no_recorder: dict[int, str],
                 now_ns: int, stacks=None):
        self.mesh = mesh
        self.groups = groups
        self.silent = silent  # ranks that did not answer
        self.no_recorder = no_recorder  # rank -> why it has nothing to say
        self.now_ns = now_ns
        self.stacks = stacks  # StackReport of the ranks behind (and the silent), or None

    def holding_up(self) -> list[int]:
        return sorted({r for g in self.groups for r in g.behind()} | set(self.silent))

    def lines(self) -> list[str]:
        out = []
        for g in self.groups:
            n = g.newest()
            waiting = g.waiting()
            op = g.ops.get(n, {})
            what = f"{op.get('op') or 'collective'} #{n}"
            if waiting:
                started = op.get("started_ns")
                ago = f" (started {max(0.0, (self.now_ns - started) / 1e9):.0f} s ago)" if started else ""
                parts = [f"{rank_label(waiting, brackets=False)} in {what}{ago}"]
                for r in g.behind():
                    where = self._where(r)
                    parts.append(f"{rank_label([r], brackets=False)} last finished #{g.finished.get(r, -1)}"
                                 + (f" and is at {where}" if where else ""))
                out.append(f"{g.name}: " + "; ".join(parts))
            else:
                out.append(f"{g.name}: every rank finished {what}" if n >= 0 else f"{g.name}: no collectives yet")
        if self.silent:
            out.append(f"{rank_label(self.silent, brackets=False)} did not answer within {ASK_S:g} s "
                       f"(stopped, or in C code holding the GIL): see their stacks")
        if not self.groups and not self.silent and len(self.no_recorder) < 1:
            out.append("no collectives yet")
        for r, why in sorted(self.no_recorder.items()):
            out.append(f"rank {r}: {why}")
        return out

    def _where(self, rank: int) -> str:
        if self.stacks is None:
            return ""
        for s in self.stacks.stacks:
            if s.rank == rank:
                for t in s.selected(False):
                    frames = t.shown(False)
                    if frames:
                        f = frames[0]
                        return f"{os.path.basename(f.filename)}:{f.line} ({f.name})"
        return ""

    def __repr__(self) -> str:
        text = [f"Collectives of mesh '{self.mesh}':", *(f"  {line}" for line in self.lines())]
        if self.stacks is not None and self.holding_up():
            text += ["", repr(self.stacks)]
        return "\n".join(text)


def collectives(procs, *, last: int = 4, stacks: bool = True, timeout: float = ASK_S) -> CollectivesReport:
    """Where each rank of ``procs`` is in its collectives (the groups ``setup_torch_distributed``
    or ``%mesh run`` made), and the stacks of the ranks the others wait for.

    Example::

        print(collectives(procs))             # where each rank is in its collectives
    """
    rec = record(procs)
    env = rec.env.flatten("rank")
    n = len(rec.ranks)
    futures = {i: env.slice(rank=i).collectives.call_one(last) for i in range(n)}
    deadline = time.monotonic() + timeout
    snaps: dict[int, dict] = {}
    silent = []
    for i, fut in futures.items():
        try:
            snaps[i] = fut.get(timeout=max(0.05, deadline - time.monotonic()))
        except TimeoutError:
            silent.append(i)
    report = build_report(procs.name, snaps, silent, time.time_ns())
    behind = report.holding_up()
    if stacks and behind:
        report.stacks = procs.stacks(behind)
    return report


def build_report(mesh: str, snaps: dict[int, dict], silent: list[int], now_ns: int) -> CollectivesReport:
    """The report from each rank's ``flight.snapshot`` (``snaps``, by index in the mesh) and
    the ranks that did not answer (``silent``); the hang watchdog builds it from its own polls."""
    groups: dict[str, GroupState] = {}
    no_recorder = {}
    for i, snap in snaps.items():
        if snap.get("recorder") is None:
            no_recorder[i] = snap.get("why", "no recorder")
            continue
        for name, g in snap.get("groups", {}).items():
            st = groups.setdefault(name, GroupState(name))
            st.entered[i] = int(g.get("last_enqueued", -1))
            st.finished[i] = int(g.get("last_completed", -1))
            for e in g.get("entries", []):
                st.ops.setdefault(int(e.get("seq", -1)), e)
    for st in groups.values():  # a rank that answered but never used the group has entered none
        for i in snaps:
            if i not in no_recorder and i not in st.entered:
                st.entered[i] = st.finished[i] = 0
    return CollectivesReport(mesh, sorted(groups.values(), key=lambda g: g.name), sorted(silent), no_recorder, now_ns)
