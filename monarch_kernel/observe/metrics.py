"""Each rank's CPU % and resident memory over the last minutes, for ``%mesh top`` and the Mesh
panel's sparklines.  Sampled only when asked (``%mesh top`` refreshing, a panel polling), so
an idle kernel sends nothing; ranks on other hosts are read by their host's agent.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

from ..runtime import Runtime, proc_stats

HISTORY = 300  # samples kept per rank (5 minutes at one a second)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class Point:
    at: float
    cpu: float | None  # percent of one core since the previous sample
    rss_mib: float | None
    gpu: float | None = None  # utilisation % of the rank's GPU (None: it uses none)
    gpu_mib: float | None = None
    pid: int | None = None  # the rank's process when sampled


class RankMetrics:
    """The samples of every rank of the session's meshes, by (mesh, rank)."""

    def __init__(self):
        self.history: dict[tuple[str, int], deque[Point]] = {}
        self._last: dict[tuple[str, int], tuple[int, float, int]] = {}  # key -> (ticks, when, pid)

    def sample(self, procs, timeout: float = 5.0) -> dict[int, Point]:
        """One sample of each rank of ``procs`` (a mesh this kernel spawned; others are blank)."""
        got, pids = usage(procs, timeout)
        return self.record(procs.name, list(procs.shape.ranks), pids, got)

    def record(self, mesh: str, ranks: list[int], pids: dict[int, int | None], got: dict) -> dict[int, Point]:
        """Add one sample of ``ranks``: ``got`` is ``usage()``'s, taken here or by the process
        that owns the mesh (a detached mesh's host, for ``monarch-kernel top``)."""
        now = time.monotonic()
        out = {}
        for r in ranks:
            key = (mesh, r)
            pid = pids.get(r)
            u = got.get(r)
            cpu = rss = gpu = gpu_mib = None
            if u is not None and pid is not None:
                ticks, rss_bytes, gpu_pct, gpu_used = u[:4]
                if gpu_pct >= 0:
                    gpu, gpu_mib = float(gpu_pct), float(gpu_used)
                rss = round(rss_bytes / (1 << 20), 1)
                before = self._last.get(key)
                if before is not None and before[2] == pid and now > before[1]:
                    cpu = round(100.0 * (ticks - before[0]) / _CLK_TCK / (now - before[1]), 1)
                self._last[key] = (ticks, now, pid)
            p = Point(now, cpu, rss, gpu, gpu_mib, pid if u is not None else None)
            self.history.setdefault(key, deque(maxlen=HISTORY)).append(p)
            out[r] = p
        return out

    def series(self, mesh: str, rank: int) -> list[Point]:
        return list(self.history.get((mesh, rank), ()))

    def forget(self, mesh: str) -> None:
        for key in [k for k in self.history if k[0] == mesh]:
            self.history.pop(key, None)
            self._last.pop(key, None)


def usage(procs, timeout: float = 5.0) -> tuple[dict, dict[int, int | None]]:
    """(rank -> (CPU ticks, RSS bytes, GPU %, GPU MiB), rank -> pid) of the ranks of ``procs``,
    a mesh this process spawned (both empty for another's)."""
    rt = Runtime.current()
    om = rt.owned_mesh(procs.ref.id)
    if om is None:
        return {}, {}
    ranks = list(procs.shape.ranks)
    done = proc_stats.sample(rt, om, ranks)
    got = done.result() if done.wait(timeout) and done.error() is None else {}
    return dict(got), {r: om.pids[r] for r in ranks}


def sparkline(values: list[float | None], top: float | None = None, width: int = 30) -> str:
    """``▁▃▇█``: the last ``width`` values scaled to ``top`` (their maximum by default)."""
    vals = [v for v in values[-width:]]
    known = [v for v in vals if v is not None]
    high = top if top else (max(known) if known else 0)
    if not high:
        return "".join(" " if v is None else SPARK[0] for v in vals)
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int(len(SPARK) * v / high))] for v in vals)


def top_table(metrics: RankMetrics, procs, hosts: dict[int, str]) -> str:
    """``%mesh top``'s table: rank, host, CPU %, RSS and their sparklines (and GPU % and
    memory where a rank uses a GPU)."""
    series = {r: metrics.series(procs.name, r) for r in procs.shape.ranks}
    gpus = any(p.gpu is not None for s in series.values() for p in s)
    head = f"{'rank':>4}  {'host':12} {'CPU %':>6}  {'CPU (last samples)':30}  {'RSS MiB':>8}  RSS"
    lines = [head + (f"{'':16}  {'GPU %':>6}  {'GPU MiB':>8}" if gpus else "")]
    for r, s in series.items():
        last = s[-1] if s else Point(0, None, None)
        cpu = "" if last.cpu is None else f"{last.cpu:.0f}"
        rss = "" if last.rss_mib is None else f"{last.rss_mib:.0f}"
        line = (f"{r:>4}  {hosts.get(r, '')[:12]:12} {cpu:>6}  {sparkline([p.cpu for p in s], 100):30}  "
                f"{rss:>8}  {sparkline([p.rss_mib for p in s], width=20):20}")
        if gpus:
            line += (f"  {'' if last.gpu is None else f'{last.gpu:.0f}':>6}  "
                     f"{'' if last.gpu_mib is None else f'{last.gpu_mib:.0f}':>8}")
        lines.append(line.rstrip())
    return "\n".join(lines)
