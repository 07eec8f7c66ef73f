"""Diagnostics: the ``monarch_kernel`` logger's handler of last resort.

Every module logs its diagnostics to ``logging.getLogger(__name__)``, a child of the
``monarch_kernel`` logger.  A process the runtime starts (a controller's runtime, a rank, a
template, a host agent, the kernel) calls ``install()``: then a record that no handler of the
application's own would see goes to stderr, the message alone, as the prints it replaces did
(a rank's stderr streams to the notebook; in the kernel a cell's stderr is that cell).  An
application that configures logging (``basicConfig``, its own handlers) gets the records there
instead, once.  Nothing is installed at import.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "monarch_kernel"
#: ``extra=`` of a record that goes to the process's own stderr, never into a notebook cell:
#: said by the kernel's background threads, about the very stream a cell would show it on.
PROCESS_STDERR = {"process_stderr": True}


class _LastResort(logging.StreamHandler):
    """Writes a record to ``sys.stderr`` as it is at that moment (ipykernel and pytest swap
    it), unless a handler nearer the root will see the record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _handled_elsewhere(record, self):
            return
        stream = sys.__stderr__ if getattr(record, "process_stderr", False) else sys.stderr
        if stream is None:  # no stderr at all (pythonw, a closed descriptor): nowhere to say it
            return
        self.setStream(stream)
        super().emit(record)


def _handled_elsewhere(record: logging.LogRecord, mine: logging.Handler) -> bool:
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(h is not mine for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


_handler: _LastResort | None = None


def install() -> logging.Handler:
    """Put the last-resort handler on the ``monarch_kernel`` logger (once per process)."""
    global _handler
    if _handler is None:
        _handler = _LastResort()
        logging.getLogger(LOGGER).addHandler(_handler)
    return _handler
