"""``RestartEvent``: the record of one restart of a mesh's ranks by its restart policy (or of
the policy giving up on a crash loop).  ``procs.events()`` lists them; the hook
``Actor.__on_restart__(event)`` receives one on every rank; the kernel shows each as a line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..runtime import RestartPolicy, rank_label

__all__ = ["RestartEvent", "RestartPolicy"]  # the policy is the runtime's, named here for the public API


@dataclass(frozen=True)
class RestartEvent:
    """``kind``: "restart" (``ranks`` were replaced), "gave-up" (a crash loop: past
    ``max_restarts`` within the window, the mesh failed; ``deaths`` lists the window's deaths
    as ``(time, rank, cause)``) or "failed" (the replacement could not be made: its host is
    gone, or it did not come up; ``error`` says why).  ``reason``: "died", or "hung" when the
    watchdog killed it.  ``seconds``: from the death to every replacement answering its
    ``__init__``.  ``moved_from``: per rank of ``ranks``, the host it left, for one restarted on
    another host because its own was gone ("" for one restarted where it was); ``hosts`` says
    where each is now.

    Example::

        class Trainer(Actor):
            def __on_restart__(self, event: RestartEvent) -> None:
                if event.kind == "restart":
                    print(f"ranks {event.ranks} replaced after {event.seconds:.1f} s")

        procs.events()[-1].kind      # "restart"
    """

    mesh: str
    kind: str
    ranks: tuple[int, ...]
    causes: tuple[str, ...]
    reason: str = "died"
    hosts: tuple[str, ...] = ()
    pids: tuple[int | None, ...] = ()
    died_at: float = 0.0
    at: float = 0.0
    restarts: int = 0
    index: int = 0
    deaths: tuple[tuple[float, int, str], ...] = field(default=())
    error: str = ""
    moved_from: tuple[str, ...] = ()

    def moves(self) -> list[tuple[int, str, str]]:
        """``(rank, old host, new host)`` of each rank restarted on another host."""
        return [(r, old, new) for r, old, new in zip(self.ranks, self.moved_from, self.hosts, strict=False) if old]

    @property
    def seconds(self) -> float:
        return max(0.0, self.at - self.died_at)

    def line(self) -> str:
        """One line for the running cell and the panel's history."""
        ranks = rank_label(list(self.ranks), brackets=False)
        why = "; ".join(sorted(set(self.causes)))
        if self.kind == "failed":
            return f"[{self.mesh}] {ranks} was {why}: not restarted: {self.error}"
        if self.kind == "gave-up":
            return (f"[{self.mesh}] {ranks} was {why}: not restarted, {len(self.deaths)} deaths within the restart "
                    f"window (a crash loop); the mesh failed")
        stuck = "hung and was killed by the watchdog" if self.reason == "hung" else f"was {why}"
        pids = ", ".join(str(p) for p in self.pids if p is not None)
        moved = "".join(f", rank {r} moved from {old} (gone) to {new}" for r, old, new in self.moves())
        return (f"[{self.mesh}] {ranks} {stuck}: restarted in {self.seconds:.2f} s"
                f"{f' (pid {pids})' if pids else ''}{moved}, restart {self.restarts} in the window")

    def when(self) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.at or self.died_at))
