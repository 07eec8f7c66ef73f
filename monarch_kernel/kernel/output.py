"""Rank output in the notebook: lines stream into the running cell as they arrive, and the
same line from several ranks within a short window collapses to one
(``[ranks 0-3] epoch 1 done``).  Runs on the IO thread; writes through the kernel's own
stdout/stderr, so output lands in the cell that is running."""

from __future__ import annotations

import contextvars
import sys
import threading

from .console import SYNC

WINDOW_S = 0.15  # how long a line waits for the same line from other ranks


def rank_label(ranks) -> str:
    """``[rank 3]`` or ``[ranks 0-3,5]``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]"
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev > start else f"{start}")
        if r is not None:
            start = prev = r
    return f"[ranks {','.join(spans)}]"


class CollapsingSink:
    """A ``Runtime.output_sink`` for notebooks.

    Each distinct line waits ``WINDOW_S`` after it first arrives for the same line from
    other ranks, then prints once with every rank that sent it; lines print in the order
    they first arrived.
    """

    def __init__(self, loop):
        self._loop = loop
        self._pending: dict[tuple[str, str, str], tuple[set, float]] = {}  # insertion-ordered
        self._lock = threading.Lock()
        self._synced: dict[str, set] = {}
        self._sync_cv = threading.Condition(self._lock)
        self._tick_scheduled = False
        # The running cell's context: ipykernel keeps the cell's parent header in a
        # context variable, so output written under it lands in that cell.
        self.context: contextvars.Context | None = None
        self.last_lines: dict[tuple[str, int], str] = {}  # (mesh, rank) -> last line, for status
        self.hold = False  # --no-stream: keep lines until the cell ends
        self._held: list = []

    def follow_cell(self, *_args) -> None:
        """Called at the start of each cell, on the kernel's main thread."""
        self.context = contextvars.copy_context()

    def __call__(self, mesh: str, rank: int, stream: str, line: str) -> None:
        if line.startswith(SYNC):
            with self._sync_cv:
                self._synced.setdefault(line[len(SYNC):], set()).add((mesh, rank, stream))
                self._sync_cv.notify_all()
            return
        key = (mesh, stream, line)
        self.last_lines[(mesh, rank)] = line
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = ({rank}, self._loop.time() + WINDOW_S)
            else:
                entry[0].add(rank)
            schedule = not self._tick_scheduled
            self._tick_scheduled = True
        if schedule:
            self._loop.call_later(WINDOW_S, self._tick)

    def _tick(self) -> None:
        """On the IO thread: print the lines whose window has closed."""
        now = self._loop.time()
        with self._lock:
            due = []
            for key, (ranks, deadline) in self._pending.items():
                if deadline > now:
                    break
                due.append((key, ranks))
            for key, _ in due:
                del self._pending[key]
            nxt = next(iter(self._pending.values()), None)
            self._tick_scheduled = nxt is not None
            if self.hold:
                self._held.extend(due)
                due = []
        if nxt is not None:
            self._loop.call_later(max(nxt[1] - now, 0.001), self._tick)
        self._emit(due)

    def flush(self, by_rank: bool = False) -> None:
        """Print everything pending or held now (any thread); ``by_rank`` groups the lines
        by the first rank that printed them instead of by arrival."""
        with self._lock:
            due = self._held + [(k, ranks) for k, (ranks, _d) in self._pending.items()]
            self._held = []
            self._pending.clear()
        if by_rank:
            due.sort(key=lambda item: min(item[1]))
        self._emit(due)

    def _emit(self, due) -> None:
        if not due:
            return
        if self.context is not None:
            self.context.run(self._write, due)
        else:
            self._write(due)

    @staticmethod
    def _write(due) -> None:
        for (_mesh, stream, line), ranks in due:
            out = sys.stderr if stream == "stderr" else sys.stdout
            try:
                out.write(f"{rank_label(ranks)} {line}\n")
                out.flush()
            except (ValueError, OSError):
                pass

    def finished(self, token: str) -> int:
        """How many ranks have finished the cell marked ``token`` (their stdout marker)."""
        with self._lock:
            return sum(1 for _m, _r, stream in self._synced.get(token, ()) if stream == "stdout")

    def wait_synced(self, token: str, expected: set, timeout: float, by_rank: bool = False) -> bool:
        """Block until every (mesh, rank, stream) in ``expected`` sent ``token``'s marker."""
        with self._sync_cv:
            ok = self._sync_cv.wait_for(lambda: expected <= self._synced.get(token, set()), timeout)
            self._synced.pop(token, None)
        self.flush(by_rank)
        return ok
