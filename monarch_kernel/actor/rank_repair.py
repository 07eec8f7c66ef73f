"""Repairing a mesh's ranks: SIGKILL the ones that stopped responding, replace dead ones with
fresh processes under the same rank numbers, and spawn the actors on them again.  Only the
process that spawned the mesh may (it holds the ranks' ``OwnedMesh``).  ``ProcMesh.restart``
and ``ProcMesh.kill`` hand their work here; ``%mesh restart`` and the panel's button call them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ..runtime import Kind, Runtime
from .adverbs import part_value
from .future import Future
from .spawn_message import spawn_body, spawn_options


class Restarted(NamedTuple):
    """What ``ProcMesh.restart`` did: the ranks it replaced, and which of them it killed
    first because they had stopped responding."""

    ranks: list[int]
    killed: list[int]


class RankRepair:
    """The repairs of one mesh's ranks, for the ``ProcMesh`` handles on it (``owned``: its
    ``OwnedMesh``, None for a mesh another process spawned)."""

    def __init__(self, ref, owned=None):
        self._ref = ref
        self._owned = owned

    def restart(self, rank_states: Callable[[], list[dict]], ranks: list[int] | None, actors, timeout: float, *,
                kill_unresponsive: bool) -> Restarted:
        """``ProcMesh.restart``, given its ``rank_states`` (which ranks are dead or not
        responding)."""
        self._check_owner("restart it")
        rows = rank_states()
        dead = [row["rank"] for row in rows if row["state"] == "dead"]
        stuck = [row["rank"] for row in rows if row["state"] == "not responding"] if kill_unresponsive else []
        chosen = sorted(set(dead) | set(stuck)) if ranks is None else list(ranks)
        alive = [r for r in chosen if r not in dead and r not in stuck]
        if alive:
            raise ValueError(f"ranks {alive} of mesh '{self._ref.name}' are alive; restart replaces dead ranks "
                             f"({dead or 'none are dead'}) and ones not responding ({stuck or 'none'}) only")
        killed = [r for r in chosen if r in stuck]
        if killed:
            self.kill(killed)
        if chosen:
            self._replace(chosen, actors, timeout)
        return Restarted(chosen, killed)

    def kill(self, ranks: list[int], timeout: float = 10) -> None:
        """``ProcMesh.kill``: SIGKILL ``ranks``; returns once their deaths are handled."""
        self._check_owner("kill its ranks")
        for c in Runtime.current().kill_ranks(self._owned, list(ranks)):
            if not c.wait(timeout):
                raise TimeoutError(f"timed out after {timeout:g} s waiting for ranks {list(ranks)} of "
                                   f"'{self._ref.name}' to die")

    def _replace(self, ranks: list[int], actors=(), timeout: float = 60) -> None:
        """Replace dead ``ranks`` with fresh processes (same rank numbers), then spawn
        ``actors`` on them again."""
        rt = Runtime.current()
        for c in rt.restart_ranks(self._owned, ranks):
            if not c.wait(timeout):
                raise TimeoutError(
                    f"timed out after {timeout:g} s waiting for restarted ranks of '{self._ref.name}' to connect")
            c.result()
        for mesh, cls, args, kwargs in actors:
            body = spawn_body(cls, args, kwargs)
            pending = rt.call(self._ref, mesh.actor_id, "__init__", list(ranks), body, kind=Kind.SPAWN,
                              options=spawn_options(cls))

            def check(parts, name=mesh.name):
                for r in ranks:
                    part_value(parts[r], name, "__init__")

            Future(pending.completion, check, pending.inbox).get(timeout=timeout)

    def _check_owner(self, what: str) -> None:
        if self._owned is None:
            raise RuntimeError(f"mesh '{self._ref.name}' was spawned by another process; only its owner can {what}")
