"""Rank output in the notebook: lines stream into the running cell as they arrive, and the
same line from several ranks within a short window collapses to one
(``[ranks 0-3] epoch 1 done``).  Runs on the IO thread; writes through the kernel's own
stdout/stderr, so output lands in the cell that is running."""

from __future__ import annotations

import contextvars
import sys
import threading

from .console import SYNC

WINDOW_S = 0.05


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
    """A ``Runtime.output_sink`` for notebooks."""

    def __init__(self, loop):
        self._loop = loop
        self._pending: dict[tuple[str, str, str], set[int]] = {}
        self._order: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._synced: dict[str, set] = {}
        self._sync_cv = threading.Condition(self._lock)
        self._flush_scheduled = False
        # The running cell's context: ipykernel keeps the cell's parent header in a
        # context variable, so output written under it lands in that cell.
        self.context: contextvars.Context | None = None

    def follow_cell(self, *_args) -> None:
        """Called at the start of each cell, on the kernel's main thread."""
        self.context = contextvars.copy_context()

    def __call__(self, mesh: str, rank: int, stream: str, line: str) -> None:
        if line.startswith(SYNC):
            self.flush()
            with self._sync_cv:
                self._synced.setdefault(line[len(SYNC):], set()).add((mesh, rank, stream))
                self._sync_cv.notify_all()
            return
        key = (mesh, stream, line)
        with self._lock:
            if key not in self._pending:
                self._pending[key] = set()
                self._order.append(key)
            self._pending[key].add(rank)
            schedule = not self._flush_scheduled
            self._flush_scheduled = True
        if schedule:
            self._loop.call_later(WINDOW_S, self.flush)

    def flush(self) -> None:
        with self._lock:
            order, pending = self._order, self._pending
            self._order, self._pending = [], {}
            self._flush_scheduled = False
        if not order:
            return
        if self.context is not None:
            self.context.run(self._write, order, pending)
        else:
            self._write(order, pending)

    @staticmethod
    def _write(order, pending) -> None:
        for key in order:
            _mesh, stream, line = key
            out = sys.stderr if stream == "stderr" else sys.stdout
            try:
                out.write(f"{rank_label(pending[key])} {line}\n")
                out.flush()
            except (ValueError, OSError):
                pass

    def wait_synced(self, token: str, expected: set, timeout: float) -> bool:
        """Block until every (mesh, rank, stream) in ``expected`` sent ``token``'s marker."""
        with self._sync_cv:
            ok = self._sync_cv.wait_for(lambda: expected <= self._synced.get(token, set()), timeout)
            self._synced.pop(token, None)
        self.flush()
        return ok
