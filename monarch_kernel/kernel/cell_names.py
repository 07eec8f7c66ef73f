"""Notebook cells named as IPython's tracebacks name them, in what the kernel shows of the
ranks' code (``%mesh stacks``, the watchdog, the Mesh panel's stacks): a frame in a cell is
``cell [5], line 4: time.sleep(20)``, not ``<module> (4060393333.py:4)``.

ipykernel compiles each cell under a file name hashed from its text, and IPython keeps which
execution count each such name belongs to (``Cell In[5], line 4`` in a traceback); this asks
IPython, and quotes the line from the cell's own text.  Runs in the kernel; it only reads.
"""

from __future__ import annotations

import collections
import linecache

from ..observe.stack_report import Frame

KEEP = 200  # %%mesh cells whose text is kept for quoting (the newest)


class CellNames:
    """The cells of one IPython shell, by the file names their code runs under."""

    def __init__(self, shell):
        self.shell = shell
        # A %%mesh cell's text as typed: IPython's line cache holds the transformed cell, one
        # line that calls the magic, while the ranks run (and number) the cell as typed.
        self._texts: collections.OrderedDict[str, list[str]] = collections.OrderedDict()

    def remember(self, filename: str, text: str) -> None:
        """``text`` is the cell that compiles under ``filename`` (on the ranks)."""
        self._texts[filename] = text.splitlines()
        self._texts.move_to_end(filename)
        while len(self._texts) > KEEP:
            self._texts.popitem(last=False)

    def label(self, filename: str) -> str | None:
        """``cell [5]`` for the file name of the cell run as ``In[5]``; None for other files."""
        fmt = getattr(getattr(self.shell, "compile", None), "format_code_name", None)
        named = fmt(filename) if fmt is not None else None
        if not named or not named[1].startswith("In["):
            return None
        return f"cell {named[1][2:]}"

    def line(self, filename: str, lineno: int) -> str:
        """The text of line ``lineno`` of a cell, stripped; "" when it is not known."""
        text = self._texts.get(filename)
        if text is not None:
            return text[lineno - 1].strip() if 0 < lineno <= len(text) else ""
        return linecache.getline(filename, lineno).strip()

    def frame(self, frame: Frame) -> str | None:
        """A frame in a cell as tracebacks name it: ``cell [5], line 4: time.sleep(20)``
        (``<module>``), ``step (cell [3], line 9: loss.backward())`` in a function; None for
        frames outside the notebook's cells (shown as they are)."""
        label = self.label(frame.filename)
        if label is None:
            return None
        where = f"{label}, line {frame.line}" if frame.line else label
        source = self.line(frame.filename, frame.line) if frame.line else ""
        if source:
            where += f": {source}"
        return where if frame.name == "<module>" else f"{frame.name} ({where})"
