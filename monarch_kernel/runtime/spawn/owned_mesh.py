"""``OwnedMesh``: what a process holds for each mesh it spawned: its ranks' pids and
sources, which are up and alive, their last heartbeats, and the completions its spawner,
restarts, kills and stop wait on.  Written by the launcher only (on the IO thread); the
supervision policy and ``ProcMesh`` read it.
"""

from __future__ import annotations

import sys
import time

from .. import config
from ..completion import Completion
from ..context import MeshRef
from .rank_output import LineReader
from .restart_policy import RestartBudget


class OwnedMesh:
    def __init__(self, ref: MeshRef, owner_actor):
        n = ref.size
        self.ref = ref
        self.owner_actor = owner_actor  # ActorContext of the actor that spawned it, if any
        self.pids: list[int | None] = [None] * n
        self.readers: list[list[LineReader]] = [[] for _ in range(n)]
        self.up: set[int] = set()
        self.alive: set[int] = set(range(n))
        self.ready = Completion()
        self.exited = Completion()
        self.stopping = False
        self.restarting: dict[int, Completion] = {}  # rank -> connected again
        self.env: dict = {}
        self.last_beat: list[float] = [0.0] * n  # monotonic time of each rank's last heartbeat
        self.dying: dict[int, Completion] = {}  # rank -> its death was handled (kill())
        self.bootstrap: bytes | None = None  # pickled function each rank runs before its hello
        self.python: str = sys.executable  # the interpreter its ranks run (one template each)
        self.links: list | None = None  # per rank, the AgentLink of its host; None: forked here
        self.sources: list[str | None] = [None] * n  # per rank, the template that forked it
        self.restart_budget = RestartBudget()  # its restart policy, and the deaths it replaced

    def silent_for(self, rank: int) -> float:
        """Seconds since ``rank`` last showed it is alive (0 before it is up)."""
        if rank not in self.up or rank not in self.alive:
            return 0.0
        return max(0.0, time.monotonic() - self.last_beat[rank])

    def responding(self, rank: int) -> bool:
        return self.silent_for(rank) < config.heartbeat_timeout()

    def rank_info(self, rank: int) -> dict:
        return {"rank": rank, "pid": self.pids[rank], "host": self.ref.hosts[rank], "remote": self.links is not None,
                "alive": rank in self.alive, "up": rank in self.up,
                "responding": self.responding(rank), "silent_s": round(self.silent_for(rank), 1)}
