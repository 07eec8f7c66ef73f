"""Rank output in the notebook: lines stream into the running cell as they arrive, and the
same line printed by several ranks at the same point of their output, within a short
window, collapses to one (``[ranks 0-3] epoch 1 done``).  A line still being written (a
prompt, a progress bar) or the cell's progress line shows as the cell's last line, redrawn
in place after a ``\r`` (as JupyterLab and nbclient apply it), and blanked when the cell
ends (a cell that showed nothing else keeps its progress line, saying how long it took).

The collapsing itself (and its promise never to drop, merge away or reorder a rank's own
lines) is ``collapse.Collapser``'s.  Lines are written by a thread of its own, many per write,
so a flood becomes a few large iopub messages and a slow notebook never stalls the runtime's
IO thread.
"""

from __future__ import annotations

import collections
import contextvars
import sys
import threading
import time

from ..runtime import config
from .cell_tail import CellTail, Shown
from .collapse import WINDOW_S, Collapser, Entry
from .rank_text import RankText

BATCH_GAP_S = config.seconds("output_batch_gap")
WRITE_CHARS = 1 << 20  # a batch is written (one iopub message) at most about this big
TAIL_GAP_S = config.seconds("output_tail_gap")


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

    def write_waiting(self) -> None:
        """Write now the lines waiting for the same line from other ranks, the tail kept as it
        is: a plain cell ends, and every rank's output up to its answers is in
        (``Runtime.drain_output``), so they wait for nothing more; written later, they would
        show in the next cell.  Under ``--no-stream`` a ``%%mesh`` cell's own end writes them."""
        with self._emit_lock:
            with self._cv:
                if self.hold or not self._lines:
                    return
                due = self._lines.take_all()
                wanted = self._last.wanted(self.hold)
            self._emit(due, wanted)

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
