"""``ProfileReport``: what ``spmd.profile(procs)`` and ``%%mesh --profile`` show: the top ops by
total time with each op's slowest rank and its spread across ranks, each rank's step
times (a plot in a notebook), the ranks that took more than 20% over the median, and the
merged trace's path.  Pure data and text (matplotlib only when drawn)."""

from __future__ import annotations

import base64
import html
import io
import statistics
from dataclasses import dataclass, field

from ...runtime import counted, rank_label

STRAGGLER = 1.2  # a rank whose time in the block is over this times the median is named


@dataclass
class RankProfile:
    rank: int
    host: str
    pid: int
    block_s: float
    offset_us: float  # the rank's clock minus the controller's
    ops: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (calls, total µs)
    steps: list[float] = field(default_factory=list)  # µs


class ProfileReport:
    """What ``profile(procs)`` measured: the merged trace's ``path``, each rank's times, and
    ``stragglers()``, the ranks slower than the others.

    Example::

        with profile(procs) as prof:
            trainers.step.call(8).get()
        print(prof.path, prof.stragglers())
    """

    def __init__(self, mesh: str, path: str, ranks: list[RankProfile]):
        self.mesh = mesh
        self.path = path  # the merged Chrome trace (open it in Perfetto or chrome://tracing)
        self.ranks = sorted(ranks, key=lambda r: r.rank)

    def stragglers(self) -> list[int]:
        """Ranks whose time in the profiled block is more than 20% above the median."""
        times = [r.step_s for r in self._timed()]
        if not times:
            return []
        med = statistics.median(times)
        return [r.rank for r in self._timed() if med > 0 and r.step_s > STRAGGLER * med]

    def _timed(self) -> list:
        """Per rank, the time that counts: its steps' total if it marked steps, else the block."""
        out = []
        for r in self.ranks:
            out.append(_Timed(r.rank, sum(r.steps) / 1e6 if r.steps else r.block_s))
        return out

    def top_ops(self, n: int = 15) -> list[dict]:
        """The ops with the most total time (mean over ranks): calls, mean ms, the slowest
        rank and its ms, and the spread ((max - min) / mean, %)."""
        names = {name for r in self.ranks for name in r.ops}
        rows: list[dict] = []
        for name in names:
            per = {r.rank: r.ops.get(name, (0, 0.0)) for r in self.ranks}
            totals = [t for _c, t in per.values()]
            mean = statistics.fmean(totals) if totals else 0.0
            slow = max(per, key=lambda k: per[k][1])
            rows.append({"op": name, "calls": sum(c for c, _t in per.values()), "mean_ms": mean / 1e3,
                         "slowest_rank": slow, "slowest_ms": per[slow][1] / 1e3,
                         "spread_pct": 100 * (max(totals) - min(totals)) / mean if mean else 0.0})
        rows.sort(key=lambda r: -float(r["mean_ms"]))
        return rows[:n]

    def straggler_line(self) -> str:
        slow = self.stragglers()
        if not slow:
            return "no straggler: every rank within 20% of the median"
        med = statistics.median(t.step_s for t in self._timed())
        worst = max((t for t in self._timed() if t.rank in slow), key=lambda t: t.step_s)
        return (f"straggler: {rank_label(slow, brackets=False)} over 20% above the median "
                f"({worst.step_s:.3f} s against {med:.3f} s)")

    def __repr__(self) -> str:
        lines = [f"Profile of mesh '{self.mesh}': {counted(len(self.ranks), 'rank')}; trace: {self.path}",
                 f"  {self.straggler_line()}",
                 f"  {'op':40} {'calls':>7} {'mean ms':>9} {'slowest':>8} {'its ms':>9} {'spread':>7}"]
        for row in self.top_ops():
            slowest = f"rank {row['slowest_rank']}"
            lines.append(f"  {row['op'][:40]:40} {row['calls']:>7} {row['mean_ms']:>9.2f} "
                         f"{slowest:>8} {row['slowest_ms']:>9.2f} {row['spread_pct']:>6.0f}%")
        lines.append("  time per rank: " + ", ".join(f"{t.rank}: {t.step_s:.3f} s" for t in self._timed()))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'><code>{html.escape(r['op'])}</code></td><td>{r['calls']}</td>"
            f"<td>{r['mean_ms']:.2f}</td><td>rank {r['slowest_rank']}</td><td>{r['slowest_ms']:.2f}</td>"
            f"<td>{r['spread_pct']:.0f}%</td></tr>" for r in self.top_ops())
        plot = self._plot_png()
        img = f"<img src='data:image/png;base64,{plot}' alt='step time per rank'/>" if plot else ""
        return (f"<div class='monarch-profile'><b>Profile of mesh '{html.escape(self.mesh)}'</b>: "
                f"{counted(len(self.ranks), 'rank')}; trace <code>{html.escape(self.path)}</code><br>"
                f"{html.escape(self.straggler_line())}<table><tr><th>op</th><th>calls</th><th>mean ms</th>"
                f"<th>slowest</th><th>its ms</th><th>spread</th></tr>{rows}</table>{img}</div>")

    def _plot_png(self) -> str:
        """Each rank's step times (or its time in the block), as a PNG; "" without matplotlib."""
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return ""
        fig = Figure(figsize=(5, 2.4))
        ax = fig.add_subplot()
        if any(r.steps for r in self.ranks):
            for r in self.ranks:
                ax.plot([s / 1e3 for s in r.steps], label=f"rank {r.rank}", linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel("ms")
            if len(self.ranks) <= 8:
                ax.legend(fontsize=6)
        else:
            ax.bar([str(t.rank) for t in self._timed()], [t.step_s for t in self._timed()])
            ax.set_xlabel("rank")
            ax.set_ylabel("s in the block")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        return base64.b64encode(buf.getvalue()).decode()


@dataclass
class _Timed:
    rank: int
    step_s: float
