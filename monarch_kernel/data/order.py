"""Issue order for one process's transfers: two transfers it starts on the same buffer whose
bytes overlap, at least one of them a write, take effect in the order it started them, on
every transport, however many worker threads and connections carry them.  It must never
park a worker thread to wait (a transfer that must wait is started by the one it waits for)
nor order transfers that cannot see each other (other buffers, disjoint bytes, two reads).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Hashable

# Without this, write_from(zeros) then write_from(twos), both started before either had
# finished (awaited together, asyncio.gather), ran at once on two worker threads and two
# connections, and the owner (one thread per connection) applied their bytes interleaved:
# the buffer could end with some of the zeros.  Every transfer now records what it must wait
# for when it is started (when its Future is first awaited or read), in the caller's thread,
# so "started first" is the caller's order.


class _Pending:
    __slots__ = ("write", "lo", "hi", "run", "waits", "then")

    def __init__(self, write: bool, lo: int, hi: int, run: Callable[[], None]):
        self.write, self.lo, self.hi, self.run = write, lo, hi, run
        self.waits = 0  # earlier transfers still running that this one must follow
        self.then: list[_Pending] = []  # later transfers that follow this one

    def conflicts(self, other: _Pending) -> bool:
        return (self.write or other.write) and self.lo < other.hi and other.lo < self.hi


class IssueOrder:
    """The transfers this process has started and not finished, per buffer; ``start`` runs
    one (a thread pool's ``submit``) once every earlier conflicting one has finished.

    Example::

        order = IssueOrder(pool.submit)
        order.issue(("owner", 7), True, 0, 1 << 20, write_zeros)
        order.issue(("owner", 7), True, 0, 1 << 20, write_twos)   # runs after write_zeros
    """

    def __init__(self, start: Callable[[Callable[[], None]], object]):
        self._start = start
        self._lock = threading.Lock()
        self._pending: dict[Hashable, list[_Pending]] = {}
        self.pid = os.getpid()  # a forked child starts its own (these transfers are not its)

    def issue(self, buffer: Hashable, write: bool, lo: int, hi: int, run: Callable[[], None],
              inline: bool = False) -> None:
        """Run ``run`` (which must not raise) on bytes ``lo..hi`` of ``buffer`` after every
        transfer issued earlier that conflicts with it.  ``inline``: when nothing is in its
        way, run it here, on the caller's thread (a copy too short to be worth a hop)."""
        p = _Pending(write, lo, hi, run)
        with self._lock:
            pending = self._pending.setdefault(buffer, [])
            for q in pending:
                if q.conflicts(p):
                    q.then.append(p)
                    p.waits += 1
            pending.append(p)
            ready = p.waits == 0  # read under the lock: a finishing transfer may start p itself
        if ready and inline:
            self._run(buffer, p)
        elif ready:
            self._start(functools.partial(self._run, buffer, p))

    def running(self, buffer: Hashable) -> int:
        """Transfers on ``buffer`` started and not finished (waiting ones included)."""
        with self._lock:
            return len(self._pending.get(buffer, ()))

    def _run(self, buffer: Hashable, p: _Pending) -> None:
        try:
            p.run()
        finally:
            ready = []
            with self._lock:
                pending = self._pending[buffer]
                pending.remove(p)
                if not pending:
                    del self._pending[buffer]
                for q in p.then:
                    q.waits -= 1
                    if q.waits == 0:
                        ready.append(q)
            for q in ready:
                self._start(functools.partial(self._run, buffer, q))
