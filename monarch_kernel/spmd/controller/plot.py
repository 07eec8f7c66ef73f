"""``LossPlot``: a live plot in the notebook with one line per rank, fed by the ranks while
a cell runs (``plot.log(step, loss)`` on each rank), redrawn at most every ``every_s``.

The plot is an actor hosted by the kernel's own process (``this_proc().spawn``); ranks
hold a picklable handle and send it fire-and-forget messages, so logging never waits for
the notebook.  Only the actor draws (matplotlib's Agg, without pyplot); IPython and
matplotlib are imported when a plot is made, never at import.
"""

from __future__ import annotations

import base64
import contextvars
import io
import threading
import time

from ...actor.actor import Actor, current_rank
from ...actor.endpoint import endpoint

MAX_POINTS = 400  # per line drawn: more are thinned out


class LossPlot:
    """One line per rank of a value per step, drawn live in the cell that shows it.

    For example::

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
        from ...actor.host_mesh import this_proc

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
    """Hosted by the kernel: keeps the points; a drawing thread of its own redraws at most
    every ``every_s``, so logging stays cheap however slow a drawing is."""

    def __init__(self, title: str, ylabel: str, logy: bool, every_s: float):
        self.title, self.ylabel, self.logy, self.every_s = title, ylabel, logy, every_s
        self.series: dict[int, list[tuple[int, float]]] = {}
        self.marks: list[tuple[int, str]] = []
        self.displays: list[str] = []
        self.lock = threading.Lock()  # the points
        self.draw_lock = threading.Lock()  # one drawing at a time
        self.dirty = threading.Event()
        self.drawer: threading.Thread | None = None

    @endpoint
    def add_display(self, display_id: str) -> None:
        self.displays.append(display_id)
        self._draw_now()

    @endpoint
    def log(self, rank: int, step: int, value: float) -> None:
        with self.lock:
            self.series.setdefault(rank, []).append((step, value))
        self.dirty.set()
        if self.drawer is None:
            self.drawer = threading.Thread(target=self._drawing, name="loss-plot", daemon=True)
            self.drawer.start()

    @endpoint
    def mark(self, step: int, label: str) -> None:
        with self.lock:
            self.marks.append((step, label))
        self._draw_now()

    @endpoint
    def flush(self) -> None:
        self._draw_now()

    @endpoint
    def latest_step(self) -> int:
        with self.lock:
            return max((s for pts in self.series.values() for s, _ in pts), default=-1)

    @endpoint
    def history(self) -> dict:
        with self.lock:
            return {r: list(pts) for r, pts in sorted(self.series.items())}

    def _drawing(self) -> None:
        while True:
            self.dirty.wait()
            self.dirty.clear()
            self._draw_now()
            time.sleep(self.every_s)

    def _draw_now(self) -> None:
        # An empty context: ipykernel then sends the update under the cell running now, not
        # the one that spawned this actor (whose context a worker thread would carry).
        contextvars.Context().run(self._draw)

    def _draw(self) -> None:
        from IPython.display import update_display

        with self.draw_lock:
            with self.lock:
                series = {r: sorted(pts) for r, pts in self.series.items()}
                marks = list(self.marks)
            bundle = {"text/plain": self._text(series)}
            if series:
                bundle["image/png"] = self._png(series, marks)
            for display_id in self.displays:
                update_display(bundle, raw=True, display_id=display_id)

    def _text(self, series) -> str:
        if not series:
            return f"{self.title}: (no steps yet)"
        last = {r: pts[-1] for r, pts in sorted(series.items())}
        step = max(s for s, _ in last.values())
        return f"{self.title} at step {step}: " + ", ".join(f"rank {r} {v:.4g}" for r, (_s, v) in last.items())

    def _png(self, series, marks) -> str:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 3.0), dpi=72, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for r, pts in sorted(series.items()):
            pts = pts[:: max(1, len(pts) // MAX_POINTS)]
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"rank {r}", linewidth=1.0)
        for step, label in marks:
            ax.axvline(step, color="grey", linestyle="--", linewidth=1)
            ax.annotate(label, (step, 0.98), xycoords=("data", "axes fraction"), fontsize=8, rotation=90,
                        va="top", ha="right", color="grey")
        if self.logy:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(self.ylabel)
        ax.set_title(self.title, fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return base64.b64encode(out.getvalue()).decode()
