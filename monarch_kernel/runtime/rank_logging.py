"""Log records of a rank's actors, written to its stderr (which streams to the controller)
with the actor and rank they came from: ``[actor=Trainer 'trainers' rank 1] INFO ...``.

Installed by the rank entry point, never at import.  It is logging's handler of last resort,
so a rank whose code configures logging itself (``basicConfig``, its own handlers) keeps
exactly that configuration and never sees a record twice.  Once ``logging_option`` asks
to stream (``prefix_records``), records made inside an actor also carry Monarch's
``[actor=<root>.<mod.Cls name{point}>]`` prefix, whichever handler writes them.
"""

from __future__ import annotations

import logging
import sys

from .context import actor_name, actor_path, current_actor, process_mesh

DISABLED = logging.CRITICAL + 1  # a handler level no record reaches


class _ActorPrefix(logging.Formatter):
    """``[actor=<class> '<name>' rank <r>] LEVEL logger: message``; outside an actor the
    prefix names the rank's mesh."""

    def format(self, record: logging.LogRecord) -> str:
        if hasattr(record, "actor_prefix"):  # this handler says where itself, its own way
            record = logging.makeLogRecord({**record.__dict__, "msg": record.__dict__["actor_msg"]})
        ctx = current_actor.get()
        if ctx is not None:
            name = actor_name(ctx.actor)
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


_prefixing = False
_plain_factory = None


def _prefixed_record(*args, **kwargs) -> logging.LogRecord:
    """Monarch's actor prefix on a record made inside an actor: ``[actor=<root>.<mod.Cls
    name{point}>] message``, whichever handler writes it (the actor's own, to its stdout
    or a file); empty messages (torch's structured traces) are left as they are."""
    assert _plain_factory is not None
    record = _plain_factory(*args, **kwargs)
    ctx = current_actor.get() if _prefixing else None
    if ctx is not None:
        cls = type(ctx.instance)
        where = actor_path(None, f"{cls.__module__}.{cls.__qualname__}", ctx.actor, ctx.rank, ctx.mesh.dims)
        prefix = f"[actor={where}] "
        record.actor_prefix, record.actor_msg = prefix, record.msg
        if record.msg:
            record.msg = f"{prefix}{record.msg}"
    return record


def prefix_records(on: bool) -> None:
    """Whether records made inside actors carry Monarch's ``[actor=...]`` prefix (what
    ``logging_option(stream_to_client=True)`` asks for)."""
    global _prefixing, _plain_factory
    _prefixing = on
    if on and _plain_factory is None:
        _plain_factory = logging.getLogRecordFactory()
        logging.setLogRecordFactory(_prefixed_record)


def set_level(level: int | None) -> None:
    """Forward records at ``level`` and above; ``None``: forward none."""
    handler = _handler if _handler is not None else install(logging.INFO)
    handler.setLevel(DISABLED if level is None else level)
    root = logging.getLogger()
    if level is not None and not root.handlers and root.level > level:
        root.setLevel(level)  # else records below WARNING never reach a handler
