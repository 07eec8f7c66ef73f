"""What JupyterLab's Mesh panel shows: the kernel's meshes, their ranks and its jobs, built as
one ``PanelState`` for ``PanelFeed`` (``feed.py``) to send, with each local rank's CPU and
memory measured for the rows sent; and ``RankLog``, the ranks' recent lines for its log tab.
Runs in the kernel; it reads the session, the public mesh API and ``/proc``, and sends
nothing itself.
"""

from __future__ import annotations

import collections
import itertools
import os
import time
from typing import TYPE_CHECKING

from ...detached import listing
from ...runtime import Runtime, config
from ...tensors.controller.registry import tensor_totals
from .. import status
from ..status import rss_mib
from .messages import JobRow, MeshRow, PanelState, RankRow

if TYPE_CHECKING:
    from ..session import MeshSession

LOG_LINES = 1000  # recent lines kept per rank for the log tab
CPU_STALE_S = config.seconds("panel_cpu_stale")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int | None) -> int | None:
    """utime + stime of a local process, in clock ticks (from /proc)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


class RankLog:
    """Each rank's recent output lines, numbered in arrival order across the kernel."""

    def __init__(self, per_rank: int = LOG_LINES):
        self.per_rank = per_rank
        self._lines: dict[tuple[str, int], collections.deque] = {}
        self._seq = itertools.count(1)
        self.newest: dict[str, int] = {}  # mesh -> seq of its newest line

    def add(self, mesh: str, rank: int, stream: str, line: str) -> None:
        q = self._lines.get((mesh, rank))
        if q is None:
            q = self._lines[(mesh, rank)] = collections.deque(maxlen=self.per_rank)
        seq = next(self._seq)
        q.append((seq, rank, stream, line))
        self.newest[mesh] = seq

    def lines(self, mesh: str, since: int = 0) -> list[list]:
        got = [list(e) for (m, _r), q in list(self._lines.items()) if m == mesh for e in list(q) if e[0] > since]
        got.sort(key=lambda e: e[0])
        return got

    def forget(self, mesh: str) -> None:
        for key in [k for k in self._lines if k[0] == mesh]:
            del self._lines[key]
        self.newest.pop(mesh, None)


class PanelView:
    """Builds the panel's state from the session; keeps the CPU samples it measures from and
    the large meshes a panel asked to see in full."""

    def __init__(self, session: MeshSession, log: RankLog):
        self.session = session
        self.shell = session.shell
        self.log = log
        self.cpu: dict[int, tuple[int, float]] = {}  # pid -> (ticks, when)
        self.expanded: set[str] = set()  # large meshes whose full table a panel asked for (Request "table")

    def state(self, running: bool, cell: int = 0) -> PanelState:
        """Every mesh and job of the session, ``running``: whether a cell executes; ``cell``:
        how many cells have begun."""
        s = self.session
        dbg = getattr(getattr(self.shell, "kernel", None), "debugger", None)
        target = getattr(dbg, "target", None)
        stopped_pdb = {(st.where.mesh, st.rank) for st in s.pdb.waiting()}
        meshes = []
        for name, (procs, _consoles) in list(s.meshes.items()):
            meshes.append(self._mesh(name, procs, target, stopped_pdb))
        if len(self.cpu) > 2 * sum(m.ranks for m in meshes) + 64:  # pids of ranks gone (restarted, stopped)
            now = time.monotonic()
            self.cpu = {pid: v for pid, v in self.cpu.items() if now - v[1] <= CPU_STALE_S}
        jobs = []
        for job_name, job in list(s.jobs.jobs.items()):
            hosts = [h for _n, hm in job.state() for h in hm.host_names] if job.active else []
            jobs.append(JobRow(job_name, job.kind, job.active, hosts,
                               [m for m, j in s.jobs.meshes.items() if j == job_name]))
        debug_target = f"{target.mesh}:{target.rank}" if target is not None and hasattr(target, "rank") else ""
        return PanelState(meshes, jobs, running, listing.kernel_id(), debug_target, cell=cell)

    def _mesh(self, name: str, procs, target, stopped_pdb: set) -> MeshRow:
        """One mesh as the panel shows it.  Over ``status.SUMMARY_OVER`` ranks it is summarised
        as ``%mesh status`` is: counts by state, and rows for the ranks that are not idle only
        (every rank while a panel has it expanded); only the rows sent are measured (CPU, RSS)."""
        s = self.session
        host = s.hosts.get(name)
        rows = procs.rank_states() if host is None else host.status.call_one().get(timeout=10)
        busy = Runtime.current().busy_ranks(procs.ref.id)
        states = []
        for row in rows:
            r = row["rank"]
            state, detail = row["state"], ""
            if row["death"]:
                state, detail = "dead", str(row["death"])
            elif state == "not responding":
                detail = f"silent {row['silent_s']:.0f} s"
            elif (name, r) in stopped_pdb:
                state, detail = "pdb", "stopped in pdb"
            elif target is not None and getattr(target, "mesh", None) == name and getattr(target, "rank", None) == r:
                stopped = bool(getattr(target, "stopped_threads", None))
                state = "debugger" if stopped else ("busy" if r in busy else "idle")
                detail = "stopped in the debugger" if stopped else "JupyterLab's debugger is on this rank"
            else:
                state = "busy" if r in busy else "idle"
            states.append({"rank": r, "state": state, "detail": detail, "row": row})
        expanded = name in self.expanded
        shown = status.notable(states, expanded)
        now = time.monotonic()
        out = []
        for st in shown:
            row = st["row"]
            local = not row["death"] and not row.get("remote") and row["pid"]
            cpu = self._cpu_percent(row["pid"], now) if local else None
            rss = rss_mib(row["pid"]) if local else None
            out.append(RankRow(st["rank"], str(row["host"] or ""), row["pid"], st["state"], st["detail"],
                               None if cpu is None else round(cpu, 1), None if rss is None else round(rss, 1),
                               s.last_lines.get((name, st["rank"]), "")[:200],
                               st["rank"] in s.watchdog.odd.get(name, ())))
        tally = status.counts(states)
        kind = "detached" if host is not None else ("job" if name in s.jobs.meshes else "local")
        hosts = sorted({str(row["host"]) for row in rows if row["host"]})
        n_tensors, tensor_bytes = tensor_totals(procs.ref.id)
        return MeshRow(name, len(rows), hosts, kind, s.jobs.meshes.get(name, ""), name == s.current,
                       bool(procs.stopped), tally.get("dead", 0), self.log.newest.get(name, 0), out,
                       counts=tally, summary=shown is not states, expanded=expanded and len(rows) > status.SUMMARY_OVER,
                       tensors=n_tensors, tensor_bytes=tensor_bytes)

    def _cpu_percent(self, pid: int, now: float) -> float | None:
        ticks = cpu_ticks(pid)
        if ticks is None:
            return None
        before = self.cpu.get(pid)
        self.cpu[pid] = (ticks, now)
        if before is None or now <= before[1] or now - before[1] > CPU_STALE_S:
            return 0.0  # first seen (or not sent for a while, as an idle rank of a summarised mesh)
        return 100.0 * (ticks - before[0]) / _CLK_TCK / (now - before[1])
