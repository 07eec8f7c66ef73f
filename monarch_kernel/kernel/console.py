"""The console actor: one persistent namespace per rank, in which ``%%mesh`` cells run.

A cell's last expression is evaluated and its repr returned, as IPython does; rich output
(``IPython.display.display``, open matplotlib figures) is collected and returned for the
notebook to show under the rank's label.  After each cell the rank writes a sync marker to
stdout and stderr, so the controller knows every line the cell printed has reached it
before the cell ends.
"""

from __future__ import annotations

import ast
import base64
import io
import linecache
import sys

from ..actor.actor import Actor
from ..actor.endpoint import endpoint

SYNC = "\x1emonarch-sync "


class Console(Actor):
    def __init__(self):
        self.ns: dict = {"__name__": "__mesh__", "__builtins__": __builtins__}
        self.displays: list[tuple[dict, dict]] = []
        self._hook_display()

    def _hook_display(self) -> None:
        """Make IPython's ``display()`` on this rank collect mime bundles for the notebook."""
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
                    self.displays.append((dict(obj), dict(metadata or {})))
                else:
                    data, md = formatter.format(obj)
                    self.displays.append((data, {**md, **(metadata or {})}))

        df.display = ipd.display = display
        self.ns["display"] = display

    def _collect_figures(self) -> None:
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight")
            self.displays.append(({"image/png": base64.b64encode(buf.getvalue()).decode(),
                                   "text/plain": repr(fig)}, {}))
            plt.close(fig)

    @endpoint
    def run(self, code: str, filename: str, token: str) -> dict:
        """Run ``code``: ``{"value": repr of its last expression or None, "displays": [...]}``."""
        # Let tracebacks on this rank quote the cell's lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        self.displays = []
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), self.ns)
            value = None
            if last is not None:
                result = eval(compile(last, filename, "eval"), self.ns)
                if result is not None:
                    self.ns["_"] = result
                    value = repr(result)
            self._collect_figures()
            return {"value": value, "displays": self.displays}
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            print(SYNC + token, flush=True)
            print(SYNC + token, file=sys.stderr, flush=True)

    @endpoint
    def push(self, values: dict) -> None:
        self.ns.update(values)

    @endpoint
    def pull(self, name: str):
        try:
            return self.ns[name]
        except KeyError:
            raise NameError(f"name {name!r} is not defined on this rank") from None
