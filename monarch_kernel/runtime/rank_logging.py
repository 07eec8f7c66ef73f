"""Log records on a rank reach its stderr (which streams to the controller, into the cell) as
a user's own loggers' records would on a plain Python: WARNING and above, the message alone.

Installed by the rank entry point, never at import.  It is logging's handler of last resort,
so a rank whose code configures logging itself (``basicConfig``, its own handlers) keeps
exactly that configuration and never sees a record twice; a library's INFO records
(matplotlib's font manager) stay out of the notebook, and no prefix of ours is added.

``ProcMesh.logging_option(stream_to_client=True, level=...)`` (``stream``) forwards records
at that level and up, and records made inside an actor then carry Monarch's
``[actor=<root>.<mod.Cls name{point}>]`` prefix, whichever handler writes them.
"""

from __future__ import annotations

import logging
import sys

from .context import actor_path, current_actor

DEFAULT_LEVEL = logging.WARNING  # Python's own last resort's
DISABLED = logging.CRITICAL + 1  # a handler level no record reaches


class _Format(logging.Formatter):
    """The message alone, as Python's last resort writes it; while streaming
    (``logging_option``), ``[actor=...] LEVEL logger: message``."""

    def format(self, record: logging.LogRecord) -> str:
        if not _prefixing:
            return super().format(record)
        prefix = getattr(record, "actor_prefix", "")
        if prefix:  # the prefix first, then the record as streamed records read
            record = logging.makeLogRecord({**record.__dict__, "msg": record.__dict__["actor_msg"]})
        return f"{prefix}{record.levelname} {record.name}: {super().format(record)}"


class _Stderr(logging.StreamHandler):
    """A stream handler that looks ``sys.stderr`` up per record (tools swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


_handler: _Stderr | None = None


def install() -> logging.Handler:
    """Logging's last resort on this rank (once per process): records at WARNING and above
    that no handler of the rank's own took, the message alone, to stderr."""
    global _handler
    if _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(_Format("%(message)s"))
        _handler.setLevel(DEFAULT_LEVEL)
        logging.lastResort = _handler
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


def stream(level: int | None) -> None:
    """What ``logging_option`` asks: forward records at ``level`` and above, made inside
    actors with Monarch's ``[actor=...]`` prefix; ``None``: forward none."""
    global _prefixing, _plain_factory
    handler = install()
    handler.setLevel(DISABLED if level is None else level)
    _prefixing = level is not None
    if _prefixing and _plain_factory is None:
        _plain_factory = logging.getLogRecordFactory()
        logging.setLogRecordFactory(_prefixed_record)
    root = logging.getLogger()
    if level is not None and not root.handlers and root.level > level:
        root.setLevel(level)  # else records below WARNING never reach a handler
