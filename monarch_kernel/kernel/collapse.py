"""The collapsing of rank output: the same line printed by several ranks at the same point of
their output, within a short window, becomes one entry (``[ranks 0-3] epoch 1 done``).

It must never drop, merge away or reorder a rank's own lines: each rank's n-th copy of a
line can only join another rank's copy that comes after everything this rank has shown so
far.  Pure bookkeeping, no thread and no I/O: ``output.CollapsingSink`` feeds it and writes
what falls due.
"""

from __future__ import annotations

import bisect

from ..runtime import config, rank_label

WINDOW_S = config.seconds("collapse_window")
# A line other ranks are joining waits this long again after each join, up to HOLD_S in all:
# the ranks of a large mesh reach the same line over a second or so (their cell starts down
# the tree, on a busy machine).
JOIN_WINDOW_S = config.seconds("collapse_join_window")
HOLD_S = config.seconds("collapse_hold")

class Entry:
    """One line to show, with every rank that printed it at that point."""

    __slots__ = ("mesh", "stream", "line", "ranks", "deadline", "seq", "last_call")

    def __init__(self, mesh: str, stream: str, line: str, rank: int, deadline: float, seq: int,
                 last_call: float | None = None):
        self.mesh, self.stream, self.line = mesh, stream, line
        self.ranks = {rank}
        self.deadline, self.seq = deadline, seq
        self.last_call = deadline if last_call is None else last_call  # joins never hold it past this

    def text(self) -> str:
        return f"{rank_label(self.ranks)} {self.line}\n"


class _Copies:
    """The pending entries (by seq, ascending) that hold one line; removed from the front."""

    __slots__ = ("seqs", "head")

    def __init__(self):
        self.seqs: list[int] = []
        self.head = 0

    def first_after(self, seq: int) -> int | None:
        i = bisect.bisect_right(self.seqs, seq, self.head)
        return self.seqs[i] if i < len(self.seqs) else None

    def pop_front(self) -> bool:
        """Drop the oldest; True when none are left."""
        self.head += 1
        if self.head == len(self.seqs):
            return True
        if self.head > 64 and self.head * 2 > len(self.seqs):
            del self.seqs[:self.head]
            self.head = 0
        return False


class Collapser:
    """The pure collapsing logic: no threads, no clock, no output.

    Rank r's line joins the oldest pending entry of the same text (mesh and stream too)
    that comes after the entry r's previous line went to, or starts a new entry.  So a
    rank's repeated line starts a new entry each time (all show), two ranks' k-th copies
    of a line merge, and each rank's lines keep their order.
    """

    def __init__(self, window: float = WINDOW_S):
        self.window = window
        self._pending: dict[int, Entry] = {}  # seq -> entry, in seq order
        self._by_line: dict[tuple[str, str, str], _Copies] = {}
        self._last: dict[tuple[str, str, int], int] = {}  # (mesh, stream, rank) -> seq it last joined
        self._seq = 0

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, mesh: str, rank: int, stream: str, line: str, now: float) -> None:
        key = (mesh, stream, line)
        who = (mesh, stream, rank)
        copies = self._by_line.get(key)
        seq = copies.first_after(self._last.get(who, -1)) if copies is not None else None
        if seq is None:
            seq = self._seq
            self._seq += 1
            self._pending[seq] = Entry(mesh, stream, line, rank, now + self.window, seq,
                                       now + max(self.window, HOLD_S))
            if copies is None:
                copies = self._by_line[key] = _Copies()
            copies.seqs.append(seq)
        else:
            entry = self._pending[seq]
            entry.ranks.add(rank)
            entry.deadline = min(entry.last_call, max(entry.deadline, now + max(self.window, JOIN_WINDOW_S)))
        self._last[who] = seq

    def next_deadline(self) -> float | None:
        first = next(iter(self._pending.values()), None)
        return None if first is None else first.deadline

    def take_due(self, now: float) -> list[Entry]:
        """The entries whose window has closed, oldest first; one held open by joining
        ranks holds back those after it, so lines keep their order."""
        due = []
        for entry in self._pending.values():
            if entry.deadline > now:
                break
            due.append(entry)
        self._forget(due)
        return due

    def take_all(self) -> list[Entry]:
        due = list(self._pending.values())
        self._forget(due)
        return due

    def _forget(self, entries: list[Entry]) -> None:
        for e in entries:
            del self._pending[e.seq]
            key = (e.mesh, e.stream, e.line)
            if self._by_line[key].pop_front():
                del self._by_line[key]
