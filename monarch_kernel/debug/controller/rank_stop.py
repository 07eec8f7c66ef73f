"""``RankStop``: one rank's pdb session as the kernel sees it (where it stopped, its state,
the output not yet shown), and pdb's frame lines with the notebook's cells named as IPython
names them.  Plain data: it never sends to the rank or reads stdin (``PdbHub`` does).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..messages import Stopped


@dataclass
class RankStop:
    """One pdb session on one rank, as the kernel sees it."""

    where: Stopped
    state: str = "starting"  # starting | waiting | sent | stepping | running | ended
    output: list = field(default_factory=list)
    lineno: int = 0
    filename: str = ""
    # file name -> ``Cell In[7]`` for the notebook's cells (``PdbHost.cell_label``), else None
    names: Callable[[str], str | None] | None = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return self.where.rank

    @property
    def key(self) -> tuple:
        return (self.where.mesh, self.where.rank, self.where.session)

    def place(self) -> str:
        line = self.lineno or self.where.lineno
        if (self.filename or self.where.filename) == self.where.filename and self.where.cell:
            return f"cell line {line}"
        filename = self.filename or self.where.filename
        label = self.names(filename) if self.names is not None else None
        return f"{label}, line {line}" if label else f"{filename}:{line}"

    def take_output(self) -> str:
        text, self.output = "".join(self.output), []
        return name_cells(text, self.names) if self.names is not None else text


# pdb's frame lines: "> /tmp/ipykernel_7/12.py(4)f()" (the current one), "  /x.py(9)<module>()" (where).
_PDB_FRAME = re.compile(r"^(?P<pre>> |  )(?P<file>[^\s(][^(]*)\((?P<line>\d+)\)(?P<func>\S*\(\))(?P<rest>.*)$",
                        re.MULTILINE)


def name_cells(text: str, names: Callable[[str], str | None]) -> str:
    """pdb's frame lines in the notebook's cells named as IPython names them: ``> Cell In[7],
    line 4, in f()``, not the file ipykernel compiled the cell under."""
    def named(m: re.Match) -> str:
        label = names(m["file"])
        if not label:
            return m[0]
        func = "" if m["func"] == "<module>()" else f", in {m['func']}"
        return f"{m['pre']}{label}, line {m['line']}{func}{m['rest']}"

    return _PDB_FRAME.sub(named, text)
