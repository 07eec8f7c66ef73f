"""``ProcMesh.logging_option``: which of the ranks' log records reach the controller.

Ranks' stdout and stderr always stream to the controller, and a rank's log records reach it
as on a plain Python (WARNING and up, the message alone); what this sets is the level of the
rank's log handler and Monarch's ``[actor=...]`` prefix on records made in actors
(``runtime/rank_logging.py``), through one small actor per mesh handle, spawned the first
time it is asked.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..runtime import rank_logging
from .actor import Actor
from .endpoint import endpoint

if TYPE_CHECKING:
    from .actor_mesh import ActorMesh
    from .proc_mesh import ProcMesh


class LogControl(Actor):
    """Sets the log level of the rank it runs on."""

    @endpoint
    def set_level(self, level: int | None) -> None:
        rank_logging.stream(level)  # and Monarch's [actor=...] on the actors' records


_controls: weakref.WeakKeyDictionary[ProcMesh, ActorMesh] = weakref.WeakKeyDictionary()


async def set_logging(procs: ProcMesh, stream_to_client: bool, aggregate_window_sec: float | None,
                      level: int) -> None:
    """Forward the ranks' log records at ``level`` and up (none if not ``stream_to_client``).
    ``aggregate_window_sec`` is accepted for Monarch code; lines here stream as they come."""
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 255:
        raise ValueError(f"Invalid logging level: {level!r} (use logging.INFO, logging.ERROR, ...)")
    if aggregate_window_sec is not None and (isinstance(aggregate_window_sec, bool) or
                                             not isinstance(aggregate_window_sec, (int, float)) or
                                             aggregate_window_sec < 0):
        raise ValueError(f"aggregate_window_sec takes seconds (>= 0) or None, not {aggregate_window_sec!r}")
    control = _controls.get(procs)
    if control is None:
        control = _controls[procs] = procs.spawn("log_control", LogControl)
    await control.set_level.call(level if stream_to_client else None)

