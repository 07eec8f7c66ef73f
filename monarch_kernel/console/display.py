"""Rich output on a rank: what a cell displays (``display()``, through the rank's IPython
shell) and the matplotlib figures it leaves open become mime bundles the notebook shows
under the rank's label.

Runs on ranks.  It only collects what it is given; importing it changes nothing.
"""

from __future__ import annotations

import base64
import io
import sys


class DisplayCapture:
    """Collects what the running cell displays."""

    def __init__(self):
        self.bundles: list[tuple[dict, dict]] = []

    def add(self, data: dict, metadata: dict) -> None:
        """One displayed bundle (the shell's display publisher calls this)."""
        self.bundles.append((data, metadata))

    def take(self) -> list[tuple[dict, dict]]:
        """What the cell displayed, plus its open figures (closed after); empties the list."""
        self._collect_figures()
        out, self.bundles = self.bundles, []
        return out

    def clear(self) -> None:
        self.bundles = []

    def _collect_figures(self) -> None:
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            if len(fig.get_children()) <= 1:  # nothing drawn (only its background): nothing to show
                plt.close(fig)
                continue
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight")
            self.bundles.append(({"image/png": base64.b64encode(buf.getvalue()).decode(),
                                  "text/plain": repr(fig)}, {}))
            plt.close(fig)
