"""The console actor: one persistent namespace per rank, in which ``%%mesh`` cells run.

A cell's last expression is evaluated and its repr returned, as IPython does; rich output
(``IPython.display.display``, open matplotlib figures) is collected and returned for the
notebook to show under the rank's label.  After each cell the rank writes a sync marker to
stdout and stderr, so the controller knows every line the cell printed has reached it
before the cell ends.

A cell is compiled under the file name the kernel gives it (the one JupyterLab's debugger
uses for the whole cell) with its line numbers shifted to match the cell as shown, magic
line included, so breakpoints and tracebacks name the lines the user sees.
"""

from __future__ import annotations

import ast
import bdb
import base64
import io
import linecache
import sys

from ..actor.actor import Actor
from ..actor.endpoint import endpoint
from . import rank_debug, rank_pdb

SYNC = "\x1emonarch-sync "
LAST = "__mesh_last_value__"  # holds a cell's last expression for a moment


class Console(Actor):
    runs_on_main_thread = True  # the stop button then interrupts blocking calls at once

    def __init__(self):
        self.ns: dict = {"__name__": "__mesh__", "__builtins__": __builtins__}
        self.displays: list[tuple[dict, dict]] = []
        self._hook_display()
        rank_debug.share_namespace(self.ns)
        rank_pdb.install()

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
    def run(self, code: str, filename: str, token: str, opts: dict | None = None) -> dict:
        """Run ``code``: ``{"value": repr of its last expression or None, "displays": [...]}``.

        ``opts``: ``cell`` (the whole cell as shown), ``line_offset`` (lines of the cell
        before ``code``), ``pdb_port`` and ``post_mortem`` (distributed pdb settings).
        """
        opts = opts or {}
        offset = opts.get("line_offset", 0)
        cell = opts.get("cell", code)
        rank_pdb.configure(opts.get("pdb_port"), opts.get("post_mortem"))
        rank_pdb.config.cell_files.add(filename)
        # Let tracebacks and debuggers on this rank quote the cell's lines.
        linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
        if rank_debug.listening() is not None:
            rank_debug.write_source(filename, cell)
        self.displays = []
        try:
            tree = ast.parse(code, filename, "exec")
            ast.increment_lineno(tree, offset)
            shows = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
            if shows:
                # One code object for the whole cell, so a debugger steps onto its last line.
                last = tree.body[-1]
                tree.body[-1] = ast.copy_location(
                    ast.Assign([ast.Name(LAST, ast.Store())], last.value), last)
                ast.fix_missing_locations(tree)
            exec(compile(tree, filename, "exec"), self.ns)
            value = None
            if shows:
                result = self.ns.pop(LAST, None)
                if result is not None:
                    self.ns["_"] = result
                    value = repr(result)
            self._collect_figures()
            return {"value": value, "displays": self.displays}
        except BaseException as e:
            if rank_pdb.config.post_mortem and not isinstance(e, (KeyboardInterrupt, bdb.BdbQuit, SyntaxError)):
                tb = e.__traceback__
                while tb is not None and tb.tb_frame.f_code is sys._getframe().f_code:
                    tb = tb.tb_next  # start at the cell, not here
                if tb is not None:
                    rank_pdb.post_mortem(tb, e)
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            print(SYNC + token, flush=True)
            print(SYNC + token, file=sys.stderr, flush=True)

    @endpoint
    def debug_listen(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Start debugpy here; runs on the console's own thread so cells are traced."""
        return rank_debug.listen(host)

    @endpoint
    async def debug_setup(self, pdb_port=None, post_mortem: bool | None = None) -> None:
        """Where this rank's pdb sessions report, and whether errors stop in pdb."""
        rank_pdb.configure(pdb_port, post_mortem)

    @endpoint
    def push(self, values: dict) -> None:
        self.ns.update(values)

    @endpoint
    def pull(self, name: str):
        try:
            return self.ns[name]
        except KeyError:
            raise NameError(f"name {name!r} is not defined on this rank") from None
