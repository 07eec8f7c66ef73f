"""Rejected input, counted by (wire, reason) and logged: what this process refused to read
from another process (a forged envelope, a malformed datagram from a template, the pieces of
an unfinished same-host message past its bounds, a data-plane
peer without the key, a controller without a worker's key, a DAP frame over the limit, a
panel request of the wrong shape).

One registry per process (``REJECTS``), filled by every decoder's caller, read by tests and
by ``Runtime.stats()["rejected"]``.  A reason is logged on the ``monarch_kernel`` logger the
1st, 2nd, 4th, 8th... time it happens, so a flood of garbage cannot flood the log.  Nothing
here reads a wire; importing it starts nothing.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("monarch_kernel.rejects")

#: The wires, as counted: each decoder's caller names one of these.
WIRES = ("envelope", "zmq", "datagram", "template", "data", "dap", "tunnel", "pdb", "panel", "rest", "worker")


class Rejects:
    """Counts of rejected input by ``(wire, reason)``; thread-safe."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def count(self, wire: str, reason: str, detail: str = "", level: int = logging.WARNING) -> int:
        """Count one rejection and log it (at power-of-two counts); returns the new count."""
        with self._lock:
            n = self._counts[(wire, reason)] = self._counts.get((wire, reason), 0) + 1
        if n & (n - 1) == 0:
            log.log(level, "monarch_kernel: rejected input on the %s wire (%s)%s; %d so far",
                    wire, reason, f": {detail}" if detail else "", n)
        return n

    def get(self, wire: str, reason: str) -> int:
        with self._lock:
            return self._counts.get((wire, reason), 0)

    def snapshot(self) -> dict[tuple[str, str], int]:
        """Every count so far."""
        with self._lock:
            return dict(self._counts)


REJECTS = Rejects()


def count(wire: str, reason: str, detail: str = "", level: int = logging.WARNING) -> int:
    """Count one rejection on this process's registry (see ``Rejects.count``)."""
    return REJECTS.count(wire, reason, detail, level)


def snapshot() -> dict[tuple[str, str], int]:
    """This process's counts so far, by ``(wire, reason)``."""
    return REJECTS.snapshot()
