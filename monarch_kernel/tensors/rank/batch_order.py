"""The order of one executor's batches: which have run, and what waits for one.

Batches travel down the multicast tree and fetches straight to one rank, so they may arrive
out of order: each carries its sequence number, a batch that overtook an earlier one is held
until its turn, and a request waits until the batches sent before it have run on every stream.
Kept apart from the executor, which runs the ops, because this is bookkeeping of numbers and
threads that knows nothing of tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .streams import Streams


class BatchOrder:
    def __init__(self, streams: Streams):
        self.streams = streams
        self.done = 0  # the last batch that every stream has run (requests after it are answered)
        self._main = 0  # the last batch dispatched (and run on the main stream)
        self._pending: dict[int, int] = {}  # seq -> streams still running some of it
        self._early: dict[int, tuple] = {}  # batches that overtook an earlier one
        self._waiting: dict[int, list[Callable[[], None]]] = {}  # seq -> requests parked until it has run
        self._cond = threading.Condition()

    def run(self, seq: int, batch: tuple, run: Callable[..., None]) -> None:
        """``run(*batch)`` now if it is batch ``seq``'s turn, then each held batch whose turn
        that makes; otherwise hold it."""
        if seq != self._main + 1:
            self._early[seq] = batch
            return
        while True:
            run(*batch)
            self._dispatched(seq)
            seq += 1
            early = self._early.pop(seq, None)
            if early is None:
                return
            batch = early

    def when_run(self, seq: int, due: Callable[[], None]) -> None:
        """``due()`` once batch ``seq`` has run (now, if it has)."""
        if seq > self.done:
            with self._cond:  # a stream's thread may move ``done`` meanwhile
                if seq > self.done:
                    self._waiting.setdefault(seq, []).append(due)
                    return
        due()

    def wait(self, seq: int, timeout: float) -> bool:
        """From any thread: wait until batch ``seq`` has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done >= seq, timeout)

    def _dispatched(self, seq: int) -> None:
        """Batch ``seq`` ran on the main stream and went to the others: once they have run
        their part, requests that follow it are answered."""
        with self._cond:  # before a stream's thread marks it (it waits for the lock): fresh46
            n = self.streams.mark(self._marked, seq) if self.streams.workers else 0
            self._main = seq
            if n:
                self._pending[seq] = n
            ready = self._advance()
        for due in ready:
            due()

    def _marked(self, seq: int) -> None:
        """On a stream's thread: it ran its part of batch ``seq``."""
        with self._cond:
            left = self._pending[seq] - 1
            if left:
                self._pending[seq] = left
            else:
                del self._pending[seq]
            ready = self._advance()
        for due in ready:
            due()

    def _advance(self) -> list[Callable[[], None]]:
        """(Holding ``_cond``.) Move ``done`` over the batches every stream has run; the
        requests now due."""
        ready: list[Callable[[], None]] = []
        start = self.done
        while self.done < self._main and self.done + 1 not in self._pending:
            self.done += 1
            ready.extend(self._waiting.pop(self.done, ()))
        if self.done != start:
            self._cond.notify_all()
        return ready
