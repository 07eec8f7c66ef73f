"""Log records of a rank's actors, written to its stderr (which streams to the controller)
with the actor and rank they came from: ``[actor=Trainer 'trainers' rank 1] INFO ...``.

Installed by the rank entry point, never at import.  It is logging's handler of last resort,
so a rank whose code configures logging itself (``basicConfig``, its own handlers) keeps
exactly that configuration and never sees a record twice.
"""

from __future__ import annotations

import logging
import sys

from .context import current_actor, process_mesh

DISABLED = logging.CRITICAL + 1  # a handler level no record reaches


class _ActorPrefix(logging.Formatter):
    """``[actor=<class> '<name>' rank <r>] LEVEL logger: message``; outside an actor the
    prefix names the rank's mesh."""

    def format(self, record: logging.LogRecord) -> str:
        ctx = current_actor.get()
        if ctx is not None:
            name = ctx.actor.rsplit("-", 1)[0]
            where = f"actor={type(ctx.instance).__qualname__} '{name}' rank {ctx.rank}"
        else:
            mesh, rank = process_mesh
            where = f"mesh '{mesh.name}' rank {rank}" if mesh is not None else "rank ?"
        return f"[{where}] {super().format(record)}"


class _Stderr(logging.StreamHandler):
    """A stream handler that looks ``sys.stderr`` up per record (tools swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


_handler: _Stderr | None = None


def install(level: int = logging.INFO) -> logging.Handler:
    """Forward records at ``level`` and above to stderr (once per process); the root
    logger is opened down to ``level`` unless the rank's code already configured it."""
    global _handler
    if _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(_ActorPrefix("%(levelname)s %(name)s: %(message)s"))
        logging.lastResort = _handler
    set_level(level)
    return _handler


def set_level(level: int | None) -> None:
    """Forward records at ``level`` and above; ``None``: forward none."""
    handler = _handler if _handler is not None else install(logging.INFO)
    handler.setLevel(DISABLED if level is None else level)
    root = logging.getLogger()
    if level is not None and not root.handlers and root.level > level:
        root.setLevel(level)  # else records below WARNING never reach a handler
