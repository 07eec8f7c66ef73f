"""What the hang watchdog found on a mesh that made no progress: every rank's stacks, the flight
recorder's collectives, the ranks the others wait for and where each is stuck; written to a
file of this user's alone (``~/.local/state/monarch-kernel/hangs/<run>/``) and summarised in a
few lines for the cell, or raised as ``HangError``.

Runs in the controller.  It only reads what the watchdog gathered; it sends nothing.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ...actor.errors import HangError
from ...runtime import private_files, rank_label

_RUN = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"  # this controller's run
_count = [0]


def hangs_dir() -> str:
    """This run's folder of hang reports (0700): ``$XDG_STATE_HOME/monarch-kernel/hangs/<start>-<pid>``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "monarch-kernel", "hangs", _RUN)


@dataclass
class HangReport:
    """One hang: ``stuck`` ranks (the others wait for them), ``where`` each is, ``busy`` ranks
    (calls from here still wait on them), the stacks and collectives reports, and the file.

    Example::

        def show(report: HangReport) -> None:
            print(report.mesh, report.stuck, report.where, report.path)

        spmd.watchdog(procs, 60, on_report=show)
    """

    mesh: str
    waited: float
    busy: list[int]
    stuck: list[int]
    why: str  # how the stuck ranks were told apart ("the flight recorder", "their stacks differ", ...)
    stacks: Any = None  # StackReport
    collectives: Any = None  # CollectivesReport, where the mesh has a process group
    where: dict[int, str] = field(default_factory=dict)
    path: str | None = None
    path_error: str | None = None
    actions: list[str] = field(default_factory=list)  # what abort did

    def headline(self) -> str:
        who = rank_label(self.stuck, brackets=False)
        s = f"no progress on mesh '{self.mesh}' for {self.waited:g} s: {who} "
        s += "holds" if len(self.stuck) == 1 else "hold"
        return s + f" the others up ({self.why})"

    def lines(self) -> list[str]:
        """The cell's summary: the headline, where each stuck rank is, the collectives, the file."""
        out = [self.headline()]
        out += [f"  rank {r} is at {w}" for r, w in sorted(self.where.items())]
        if self.collectives is not None:
            out += [f"  {line}" for line in self.collectives.lines()]
        if self.stacks is not None:
            out += [f"  {line}" for line in self.stacks.summary()]
        out += [f"  {a}" for a in self.actions]
        out.append(f"  full report: {self.path}" if self.path else f"  (no report file: {self.path_error})")
        return out

    def text(self) -> str:
        """The file's text: the summary, then every rank's stacks in full."""
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        body = [f"monarch-kernel hang report, {stamp}", *self.lines(), ""]
        if self.collectives is not None:
            body += [repr(self.collectives), ""]
        if self.stacks is not None:
            body.append(repr(self.stacks))
        return "\n".join(body) + "\n"

    def write(self) -> None:
        _count[0] += 1
        folder = hangs_dir()
        name = f"hang-{self.mesh}-{time.strftime('%H%M%S')}-{_count[0]}.txt"
        try:
            private_files.private_dir(folder)
            path = os.path.join(folder, "".join(c if c.isalnum() or c in "-_." else "_" for c in name))
            self.path = path  # named in the text it writes
            private_files.write_file(path, self.text().encode())
        except OSError as e:  # a home that cannot be written: the cell still has the summary
            self.path, self.path_error = None, f"{folder}: {e}"

    def error(self) -> HangError:
        """``HangError`` naming the stuck ranks, where they are, what was done, and the file."""
        where = "; ".join(f"rank {r} at {w}" for r, w in sorted(self.where.items()))
        msg = self.headline() + (f": {where}" if where else "")
        if self.actions:
            msg += ". " + "; ".join(self.actions)
        msg += f". Full report: {self.path}" if self.path else ""
        return HangError(msg, mesh=self.mesh, ranks=list(self.stuck), where=dict(self.where), waited=self.waited,
                         report=self.path)


def stuck_ranks(busy: list[int], stacks, collectives) -> tuple[list[int], str]:
    """The ranks the others wait for, and how they were told apart: the flight recorder's
    (ranks that did not answer, or are behind and in no collective), else the ranks whose stacks could
    not be read in-process or differ from the majority, else every busy rank."""
    held = collectives.holding_up() if collectives is not None else []
    if held:
        # A rank behind in one collective but itself blocked inside an older one waits too:
        # the one to blame is silent (stopped, or holding the GIL) or outside every collective.
        # A rank the snapshot caught between two collectives, its stack already in torch.distributed,
        # is on its way into the next one (it answered, so it runs): it waits too.
        inside = {r for g in collectives.groups for r, e in g.entered.items() if e > g.finished.get(r, -1)}
        blamed = [r for r in held
                  if r in collectives.silent or (r not in inside and not _calls_torch_distributed(stacks, r))]
        return blamed or held, "the flight recorder"
    if stacks is not None:
        silent = sorted(s.rank for s in stacks.stacks if s.rank in busy and s.method != "in-process")
        if silent and len(silent) < len(busy):
            return silent, "it did not answer in-process" if len(silent) == 1 else "they did not answer in-process"
        odd = [r for r in stacks.odd_ranks() if r in busy]
        if odd:
            return odd, "its stack differs from the rest" if len(odd) == 1 else "their stacks differ from the rest"
    return sorted(busy), "every rank still running the call"


def _calls_torch_distributed(stacks, rank: int) -> bool:
    """Whether ``rank``'s user thread is inside ``torch.distributed`` (its innermost frame there)."""
    for s in stacks.stacks if stacks is not None else ():
        if s.rank == rank and not s.error:
            return any(t.frames and f"{os.sep}torch{os.sep}distributed{os.sep}" in t.frames[0].filename
                       for t in s.selected(False))
    return False


def where_stuck(stacks, rank: int, namer) -> str:
    """``all_reduce (distributed_c10d.py:2950), called from cell [4], line 6: dist.all_reduce(t)``:
    the innermost frame of the rank's first thread running user code, and the innermost frame
    in a notebook cell (``namer``) if that is another."""
    if stacks is None:
        return "an unknown place (no stacks)"
    for s in stacks.stacks:
        if s.rank != rank:
            continue
        if s.error:
            return f"an unknown place ({s.error})"
        for t in s.selected(False):
            frames = t.shown(False)
            if not frames:
                continue
            inner = stacks.frame_text(frames[0])
            cell = next((n for n in (namer(f) if namer else None for f in frames) if n), None)
            return inner if cell is None or cell == inner else f"{inner}, called from {cell}"
        return "no user code (idle)"
    return "an unknown place (not in the stacks)"
