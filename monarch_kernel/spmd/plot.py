"""``LossPlot``: a live plot in the notebook with one line per rank, fed by the ranks while
a cell runs (``plot.log(step, loss)`` on each rank), redrawn at most every ``every_s``.

The plot is an actor hosted by the kernel's own process (``this_proc().spawn``); ranks
hold a picklable handle and send it fire-and-forget messages, so logging never waits for
the notebook.  Only the actor draws (matplotlib's Agg, without pyplot); IPython and
matplotlib are imported when a plot is made, never at import.
"""

from __future__ import annotations

import base64
import io
import time

from ..actor.actor import Actor, current_rank
from ..actor.endpoint import endpoint


class LossPlot:
    """One line per rank of a value per step, drawn live in the cell that shows it::

        plot = LossPlot("DDP loss")          # in the notebook: shows an empty plot here
        %mesh push plot=plot
        %%mesh
        for step in ...:
            plot.log(step, loss.item())      # on each rank
    """

    def __init__(self, title: str = "loss", *, ylabel: str = "loss", logy: bool = True, every_s: float = 0.5,
                 _actor=None):
        if _actor is not None:  # unpickled on a rank
            self._actor = _actor
            return
        from ..mesh.host_mesh import this_proc

        self._actor = this_proc().spawn("loss_plot", _PlotActor, title, ylabel, logy, every_s)
        self._actor.initialized().get(timeout=30)
        self.show()

    def show(self) -> None:
        """Show the plot (again) in the current cell; every place it is shown stays live."""
        from IPython.display import display

        handle = display({"text/plain": "(no steps yet)"}, raw=True, display_id=True)
        self._actor.add_display.call_one(handle.display_id).get(timeout=30)

    def log(self, step: int, value: float, rank: int | None = None) -> None:
        """Add a point for ``rank`` (default: the calling rank); does not wait."""
        self._actor.log.broadcast(current_rank().rank if rank is None else rank, int(step), float(value))

    def mark(self, step: int, label: str) -> None:
        """A labelled vertical line at ``step`` (a failure, a resume)."""
        self._actor.mark.broadcast(int(step), str(label))

    def flush(self) -> None:
        """Draw now, with every point sent so far from here; waits."""
        self._actor.flush.call_one().get(timeout=30)

    def latest_step(self) -> int:
        """The highest step any rank has logged (-1 before the first)."""
        return self._actor.latest_step.call_one().get(timeout=30)

    def history(self) -> dict[int, list[tuple[int, float]]]:
        """``{rank: [(step, value), ...]}`` logged so far."""
        return self._actor.history.call_one().get(timeout=30)

    def __reduce__(self):
        return _rebuild, (self._actor,)

    def __repr__(self) -> str:
        return "LossPlot<live>"


def _rebuild(actor) -> LossPlot:
    return LossPlot(_actor=actor)


class _PlotActor(Actor):
    def __init__(self, title: str, ylabel: str, logy: bool, every_s: float):
        self.title, self.ylabel, self.logy, self.every_s = title, ylabel, logy, every_s
        self.series: dict[int, list[tuple[int, float]]] = {}
        self.marks: list[tuple[int, str]] = []
        self.displays: list[str] = []
        self.drawn_at = 0.0

    @endpoint
    def add_display(self, display_id: str) -> None:
        self.displays.append(display_id)
        self._draw()

    @endpoint
    def log(self, rank: int, step: int, value: float) -> None:
        self.series.setdefault(rank, []).append((step, value))
        if time.monotonic() - self.drawn_at >= self.every_s:
            self._draw()

    @endpoint
    def mark(self, step: int, label: str) -> None:
        self.marks.append((step, label))
        self._draw()

    @endpoint
    def flush(self) -> None:
        self._draw()

    @endpoint
    def latest_step(self) -> int:
        return max((s for pts in self.series.values() for s, _ in pts), default=-1)

    @endpoint
    def history(self) -> dict:
        return {r: list(pts) for r, pts in sorted(self.series.items())}

    def _draw(self) -> None:
        from IPython.display import update_display

        self.drawn_at = time.monotonic()
        bundle = {"text/plain": self._text()}
        if self.series:
            bundle["image/png"] = self._png()
        for display_id in self.displays:
            update_display(bundle, raw=True, display_id=display_id)

    def _text(self) -> str:
        if not self.series:
            return f"{self.title}: (no steps yet)"
        last = {r: pts[-1] for r, pts in sorted(self.series.items())}
        step = max(s for s, _ in last.values())
        return f"{self.title} at step {step}: " + ", ".join(f"rank {r} {v:.4g}" for r, (_s, v) in last.items())

    def _png(self) -> str:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 3.2), dpi=80)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for r, pts in sorted(self.series.items()):
            pts = sorted(pts)
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"rank {r}", linewidth=1.2)
        for step, label in self.marks:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1)
            ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), fontsize=8, rotation=90,
                        va="top", ha="right", color="grey")
        if self.logy:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(self.ylabel)
        ax.set_title(self._text() if len(self._text()) < 70 else self.title, fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return base64.b64encode(out.getvalue()).decode()
