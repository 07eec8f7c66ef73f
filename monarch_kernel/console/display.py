"""Rich output on a rank: ``IPython.display.display()`` and open matplotlib figures become
mime bundles the notebook shows under the rank's label.

Runs on ranks.  It patches IPython's ``display`` only through the runtime's hooks, when a
console starts, and undoes it when asked; importing it changes nothing.
"""

from __future__ import annotations

import base64
import io
import sys


class DisplayCapture:
    """Collects what the running cell displays."""

    def __init__(self):
        self.bundles: list[tuple[dict, dict]] = []
        self._handles: list = []
        self.display = None  # the function cells see as ``display``, once installed

    def install(self, hooks) -> None:
        """Make IPython's ``display()`` on this rank collect bundles (until ``remove()``)."""
        try:
            import IPython.core.display_functions as df
            import IPython.display as ipd
            from IPython.core.formatters import DisplayFormatter
        except ImportError:
            return
        formatter = DisplayFormatter()

        def display(*objs, raw: bool = False, metadata: dict | None = None, **_kwargs):
            for obj in objs:
                if raw:
                    self.bundles.append((dict(obj), dict(metadata or {})))
                else:
                    data, md = formatter.format(obj)
                    self.bundles.append((data, {**md, **(metadata or {})}))

        self.display = display
        self._handles = [hooks.patch(df, "display", display), hooks.patch(ipd, "display", display)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

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
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight")
            self.bundles.append(({"image/png": base64.b64encode(buf.getvalue()).decode(),
                                  "text/plain": repr(fig)}, {}))
            plt.close(fig)
