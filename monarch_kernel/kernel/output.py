"""Rank output in the notebook: lines stream into the running cell as they arrive, and the
same line printed by several ranks at the same point of their output, within a short
window, collapses to one (``[ranks 0-3] epoch 1 done``).  A line still being written (a
prompt, a progress bar) or the cell's progress line shows as the cell's last line, redrawn
in place after a ``\r`` (as JupyterLab and nbclient apply it), and blanked when the cell
ends (a cell that showed nothing else keeps its progress line, saying how long it took).

It must never drop, merge away or reorder a rank's own lines: each rank's n-th copy of a
line can only join another rank's copy that comes after everything this rank has shown so
far.  Lines are written by a thread of its own, many per write, so a flood becomes a few
large iopub messages and a slow notebook never stalls the runtime's IO thread.
"""

from __future__ import annotations

import bisect
import collections
import contextvars
import sys
import threading
import time

from ..runtime import config, rank_label
from .cell_tail import CellTail, Shown
from .rank_text import RankText

WINDOW_S = config.seconds("collapse_window")
# A line other ranks are joining waits this long again after each join, up to HOLD_S in all:
# the ranks of a large mesh reach the same line over a second or so (their cell starts down
# the tree, on a busy machine).
JOIN_WINDOW_S = config.seconds("collapse_join_window")
HOLD_S = config.seconds("collapse_hold")
BATCH_GAP_S = config.seconds("output_batch_gap")
WRITE_CHARS = 1 << 20  # a batch is written (one iopub message) at most about this big
TAIL_GAP_S = config.seconds("output_tail_gap")


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


def write_pieces(pieces: list[tuple[str, str]]) -> None:
    """Write ``(stream, text)`` pieces to this thread's sys.stdout/sys.stderr: one write and
    flush per run of one stream, cut after ``WRITE_CHARS`` so that no single iopub message
    grows huge."""
    i = 0
    while i < len(pieces):
        stream = pieces[i][0]
        texts, size = [], 0
        while i < len(pieces) and pieces[i][0] == stream and size < WRITE_CHARS:
            texts.append(pieces[i][1])
            size += len(texts[-1])
            i += 1
        out = sys.stderr if stream == "stderr" else sys.stdout
        try:
            out.write("".join(texts))
            out.flush()
        except (ValueError, OSError):  # the kernel's stream is closed (shutting down)
            pass


def write_entries(entries: list[Entry]) -> None:
    write_pieces([(e.stream, e.text()) for e in entries])


def one_per_rank(entries: list[Entry]) -> list[Entry]:
    """``--group-outputs rank``: every line of rank 0, then of rank 1...; a line several
    ranks printed shows under each, not merged (each rank's lines keep their order)."""
    out = [Entry(e.mesh, e.stream, e.line, r, e.deadline, e.seq) for e in entries for r in sorted(e.ranks)]
    out.sort(key=lambda e: next(iter(e.ranks)))
    return out


class CollapsingSink:
    """A ``Runtime.output_sink`` for notebooks.

    Each line waits ``WINDOW_S`` after it first arrives for the same line from other
    ranks, then prints once with every rank that sent it; lines print in the order they
    first arrived.  Called on the IO thread; only records the text there.  The cell's last
    line (the "tail") is a line a rank is still writing, else the cell's progress line.
    """

    def __init__(self, loop=None, window: float = WINDOW_S):
        # ``loop`` (the IO thread's) is accepted for callers and unused: the writer times itself.
        self._cv = threading.Condition()
        self._lines = Collapser(window)
        self._emit_lock = threading.Lock()  # one batch written at a time, in order
        self._synced: dict[str, set] = {}
        self._tokens: set[str] = set()  # the running cells' markers
        self._recent: collections.deque[str] = collections.deque(maxlen=64)  # late markers of ended cells
        self._texts: dict[tuple[str, int, str], RankText] = {}
        self._fed: dict[tuple[str, int, str], float] = {}  # when each stream last wrote (monotonic)
        self._max = config.max_line()
        self._last = CellTail()  # the cell's last line: written by the writer, under _emit_lock
        self._tail_due: float | None = None
        self._tail_at = 0.0
        self._writer: threading.Thread | None = None
        self._closed = False
        # The running cell's context: ipykernel keeps the cell's parent header in a
        # context variable, so output written under it lands in that cell.
        self._context: contextvars.Context | None = None
        self.last_lines: dict[tuple[str, int], str] = {}  # (mesh, rank) -> last line, for status
        # Called on the IO thread with each line (mesh, rank, stream, line); must be cheap
        # (the Mesh panel's log appends it and flags an update).
        self.watchers: list = []
        self.hold = False  # --no-stream: keep lines until the cell ends
        self._held: list[Entry] = []

    @property
    def context(self) -> contextvars.Context | None:
        """A fresh copy of the running cell's context, for one ``.run``: a Context can be
        entered by one thread at a time, and the writer and the kernel both write."""
        ctx = self._context
        return None if ctx is None else ctx.copy()

    def follow_cell(self, *_args) -> None:
        """Called at the start of each cell, on the kernel's main thread."""
        with self._cv:
            self._context = contextvars.copy_context()
            self._last.new_cell()

    # ------------------------------------------------------------ the IO thread

    def __call__(self, mesh: str, rank: int, stream: str, line: str) -> None:
        """A whole line (a detached host forwards lines)."""
        self.write(mesh, rank, stream, line + "\n")

    def write(self, mesh: str, rank: int, stream: str, text: str) -> None:
        """What a rank wrote, as it arrives (any piece of its stream)."""
        key = (mesh, rank, stream)
        with self._cv:
            rt = self._texts.get(key)
            if rt is None:
                rt = self._texts[key] = RankText(self._honoured, self._max)
            self._fed[key] = time.monotonic()
            lines = self._record(key, rt.feed(text))
            if self._last.set_open(key, rt.open()):
                self._redraw()
        self._watch(mesh, rank, stream, lines)

    def _honoured(self, token: str) -> bool:
        return token in self._tokens or token in self._recent

    def _record(self, key: tuple[str, int, str], events: list[tuple[str, str]]) -> list[str]:
        """Under the lock: lines to the collapser, markers counted; the lines, for the watchers."""
        mesh, rank, stream = key
        lines = []
        wake = not self._lines
        now = time.monotonic()
        for kind, value in events:
            if kind == "sync":
                self._synced.setdefault(value, set()).add(key)
                wake = True
            else:
                lines.append(value)
                self._lines.add(mesh, rank, stream, value, now)
        if lines and self._writer is None and not self._closed:
            self._writer = threading.Thread(target=self._run, name="monarch-output", daemon=True)
            self._writer.start()
        elif wake:
            self._cv.notify_all()
        return lines

    def _watch(self, mesh: str, rank: int, stream: str, lines: list[str]) -> None:
        for line in lines:
            if line.strip():  # the last line the rank printed that says something (status, the panel)
                self.last_lines[(mesh, rank)] = line
            for watch in self.watchers:
                watch(mesh, rank, stream, line)

    def _redraw(self) -> None:
        """Under the lock: the tail may have changed; the writer redraws it soon."""
        if self._tail_due is None and self._last.on:
            self._tail_due = max(time.monotonic(), self._tail_at + TAIL_GAP_S)
            if self._writer is None and not self._closed:
                self._writer = threading.Thread(target=self._run, name="monarch-output", daemon=True)
                self._writer.start()
            self._cv.notify_all()

    # ------------------------------------------------------------ the running cell (main thread)

    def expect(self, token: str) -> None:
        """A cell marked ``token`` starts: its ranks' markers are honoured from now on."""
        with self._cv:
            self._tokens.add(token)

    def progress(self, text: str | None, final: bool = False) -> None:
        """The cell's progress line (shown as the tail when no rank's line is); ``final``: the
        cell has ended, and this is the line a cell that showed nothing else keeps."""
        with self._cv:
            if final:
                self._last.summary = text
                return
            self._last.on = True
            if text != self._last.progress:
                self._last.progress = text
                self._redraw()

    # ------------------------------------------------------------ the writer

    def _run(self) -> None:
        """The writer thread: write each line once its window closes, many at a time."""
        while True:
            with self._cv:
                while not self._closed:
                    deadline = self._lines.next_deadline()
                    if self._tail_due is not None and (deadline is None or self._tail_due < deadline):
                        deadline = self._tail_due
                    if deadline is None:
                        self._cv.wait()
                        continue
                    delay = deadline - time.monotonic()
                    if delay <= 0:
                        break
                    self._cv.wait(delay)
                if self._closed:
                    return
            with self._emit_lock:
                with self._cv:
                    now = time.monotonic()
                    due = self._lines.take_due(now)
                    if self.hold:
                        self._held.extend(due)
                        due = []
                    if self._tail_due is not None and self._tail_due <= now:
                        self._tail_due = None
                    wanted = self._last.wanted(self.hold)
                    if not due and wanted is None and self._lines:
                        continue  # the line shown last has ended: it stays until it shows as a line
                self._emit(due, wanted)
            if due:
                time.sleep(BATCH_GAP_S)  # let a flood gather into the next write

    def flush(self, by_rank: bool = False, end: bool = False) -> None:
        """Print everything pending or held now (any thread) and take the tail away (until the
        next ``progress``); ``by_rank`` groups the lines by rank (``one_per_rank``) instead of by
        arrival; ``end``: the cell has ended, so lines not yet ended end here."""
        ended: list[tuple[tuple[str, int, str], str]] = []
        with self._emit_lock:
            with self._cv:
                if end:
                    for key, rt in self._texts.items():
                        line = rt.close()
                        if line is not None:
                            ended.append((key, line))
                            self._lines.add(*key[:2], key[2], line, time.monotonic())
                    self._last.open.clear()
                self._last.on = False
                due = self._held + self._lines.take_all()
                self._held = []
            if by_rank:
                due = one_per_rank(due)
            self._emit(due, None, self._last.end_summary(bool(due)) if end else None)
        for (mesh, rank, stream), line in ended:
            self._watch(mesh, rank, stream, [line])

    def _emit(self, due: list[Entry], wanted: Shown | None, summary: str | None = None) -> None:
        """Write ``due`` above the last line and that line as ``wanted`` (``CellTail.pieces``)."""
        pieces = self._last.pieces([(e.stream, e.text()) for e in due], wanted, summary)
        if not pieces:
            return
        self._tail_at = time.monotonic()
        ctx = self.context
        if ctx is not None:
            ctx.run(write_pieces, pieces)
        else:
            write_pieces(pieces)

    def close(self) -> None:
        """Print what is pending and end the writer thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=5)
        self.flush(end=True)

    def finished(self, token: str) -> int:
        """How many ranks have finished the cell marked ``token`` (their stdout marker)."""
        with self._cv:
            return sum(1 for _m, _r, stream in self._synced.get(token, ()) if stream == "stdout")

    def wait_synced(self, token: str, expected: set, quiet: float, by_rank: bool = False,
                    most: float = 120.0) -> bool:
        """Block until every (mesh, rank, stream) in ``expected`` sent ``token``'s marker,
        then show what the cell printed and end its tail.  A stream still writing is still
        bringing the cell's output (10 MB through a loaded host takes seconds after the
        rank's call returned), so it gives up only once those not yet marked were silent
        ``quiet`` seconds, or after ``most``."""
        with self._cv:
            start = time.monotonic()
            while True:
                pending = expected - self._synced.get(token, set())
                ok = not pending
                if ok:
                    break
                last = max([start, *(self._fed.get(k, 0.0) for k in pending)])
                left = min(last + quiet, start + most) - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, quiet))
            self._synced.pop(token, None)
            self._tokens.discard(token)
            self._recent.append(token)
        self.flush(by_rank, end=True)
        return ok
