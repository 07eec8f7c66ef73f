"""A mesh's restart policy and its budget: whether a rank that dies is replaced, and how many
deaths within a window are replaced before the mesh is failed instead (a crash loop).

Names after Ray's actors (``max_restarts``, -1 for no limit) and Docker's restart policies
(``"on-failure"``).  It only counts and decides; the replacing is the actor layer's
(``actor/self_healing.py``), reached through ``hooks.restart``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..failure import DeathInfo

MODES = ("never", "on-failure")


@dataclass(frozen=True)
class RestartPolicy:
    """``restart``: "never" (a death fails the mesh's callers and is a supervision event) or
    "on-failure" (a dead rank is replaced, with its actors); ``max_restarts`` deaths are
    replaced within any ``restart_window`` seconds (-1: no limit).

    Example::

        procs = this_host().spawn_procs({"gpus": 4}, restart="on-failure", max_restarts=3)
        procs.restart_policy   # RestartPolicy(restart='on-failure', max_restarts=3, restart_window=600.0)
    """

    restart: str = "never"
    max_restarts: int = 3
    restart_window: float = 600.0

    def __post_init__(self):
        if self.restart not in MODES:
            raise ValueError(f"restart={self.restart!r}: choose 'on-failure' (replace a dead rank) or 'never'")
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(f"max_restarts={self.max_restarts!r}: a count of restarts, or -1 for no limit")
        if not self.restart_window > 0:
            raise ValueError(f"restart_window={self.restart_window!r}: seconds, more than 0")

    @property
    def on_failure(self) -> bool:
        return self.restart == "on-failure"


@dataclass(frozen=True)
class Death:
    """One death the budget counted: when (``time.time()``), which rank, how."""

    at: float
    rank: int
    cause: str


class RestartBudget:
    """One mesh's policy and the deaths it replaced; any thread."""

    def __init__(self, policy: RestartPolicy | None = None):
        self.policy = policy or RestartPolicy()
        self.deaths: list[Death] = []  # every death counted, oldest first
        self._lock = threading.Lock()

    def admit(self, rank: int, info: DeathInfo, now: float | None = None) -> bool:
        """Count ``rank``'s death; True if it is to be replaced (within the budget)."""
        now = time.time() if now is None else now
        with self._lock:
            self.deaths.append(Death(now, rank, info.how()))
            limit = self.policy.max_restarts
            return limit < 0 or len(self.in_window(now)) <= limit

    def in_window(self, now: float | None = None) -> list[Death]:
        """The deaths within the policy's window, up to ``now``."""
        now = time.time() if now is None else now
        return [d for d in self.deaths if now - d.at <= self.policy.restart_window]

    def crash_loop(self, mesh: str) -> str:
        """What a mesh failed for a crash loop says: every death in the window, and why."""
        window = self.in_window()
        p = self.policy
        lines = [f"mesh '{mesh}' is in a crash loop: {len(window)} deaths within {p.restart_window:g} s, past "
                 f"max_restarts={p.max_restarts}; it is not restarted again (procs.set_restart_policy(...) "
                 "raises the limit; procs.restart() replaces the ranks by hand):"]
        for d in window:
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(d.at))} rank {d.rank} {d.cause}")
        return "\n".join(lines)
