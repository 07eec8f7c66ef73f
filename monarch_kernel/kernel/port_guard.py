"""Bytes that are not Jupyter's wire format, sent to the kernel's own Jupyter ports (a port
scanner, a stray client, the chaos run's garbage): counted, and said in one line at most
every ``EVERY_S`` seconds instead of a traceback (or the whole frame) per frame.

ipykernel (7.x) splits a frame's identities from its message before its own ``try``, and
its IOPub socket reads a subscription's first byte without checking that there is one; so
each such frame raises in a ZMQ stream's callback, and tornado logs the traceback to the
kernel's stderr, which is the running cell's.  A burst of garbage made thousands of lines
there, in pieces that split the rank output printed beside them.  Its IOPub pipe (for
forked subprocesses' output) prints each message that lacks its key whole, binary and all.
The frames are dropped either way (the kernel goes on); the guard only changes what is said
about them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback

from ..runtime import config, diagnostics

LOGGERS = ("tornado.general", "tornado.application", "asyncio")  # where ZMQ streams' callbacks' errors go
EVERY_S = config.seconds("port_guard_every")
LINE = ("monarch-kernel: dropped %d malformed frame(s) on this kernel's Jupyter ports (%s; %d in all since the "
        "kernel started); something other than a Jupyter client is connecting to them")
log = logging.getLogger(__name__)
# The innermost frame of the exception, and what it means.
REASONS = {
    "feed_identities": "no identity delimiter: not a Jupyter message",
    "_handle_subscription": "an empty IOPub subscription frame",
}


def _reason(record: logging.LogRecord) -> str | None:
    """Why ``record``'s exception is a malformed frame on a Jupyter port, or None."""
    if not record.exc_info or record.exc_info[1] is None:
        return None
    frames = traceback.extract_tb(record.exc_info[2])
    return REASONS.get(frames[-1].name) if frames else None


class PortGuard(logging.Filter):
    """Installed on tornado's loggers in the kernel process (and, with ``pipe``, on
    ipykernel's IOPub pipe): ``counts`` (reason -> frames)."""

    def __init__(self, every: float = EVERY_S):
        super().__init__()
        self.every = every
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._said_at = -float("inf")
        self._said_total = 0
        self._pipe: tuple | None = None  # (stream, its handler) while ``pipe`` guards it

    def _count(self, why: str) -> tuple | None:
        """Count one frame; the line's arguments when it is time to say so, else None."""
        now = time.monotonic()
        with self._lock:
            self.counts[why] += 1
            total = sum(self.counts.values())
            if now - self._said_at < self.every:
                return None
            new, self._said_at, self._said_total = total - self._said_total, now, total
        return new, why, total

    def filter(self, record: logging.LogRecord) -> bool:
        why = _reason(record)
        if why is None:
            return True
        said = self._count(why)
        if said is None:
            return False
        record.msg, record.args = LINE, said
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True

    def install(self, iopub_thread=None) -> PortGuard:
        for name in LOGGERS:
            logging.getLogger(name).addFilter(self)
        if iopub_thread is not None:
            self.pipe(iopub_thread)
        return self

    def pipe(self, iopub_thread) -> None:
        """Guard ipykernel's IOPub pipe (a PULL socket on 127.0.0.1 that forked
        subprocesses send their output to, each message led by a random key): a message
        without the key is counted here, where ipykernel would print it whole to the
        kernel's stderr.  Nothing is done when this ipykernel has no such pipe."""
        stream = getattr(iopub_thread, "_pipe_in", None)
        handler = getattr(iopub_thread, "_handle_pipe_msg", None)
        if stream is None or handler is None or not hasattr(iopub_thread, "_pipe_uuid"):
            return

        def guarded(msg) -> None:
            if msg and msg[0] == iopub_thread._pipe_uuid:
                handler(msg)
                return
            said = self._count("a message on the IOPub pipe without its key")
            if said is not None:
                log.warning(LINE, *said, extra=diagnostics.PROCESS_STDERR)

        self._pipe = (stream, handler)
        stream.io_loop.add_callback(stream.on_recv, guarded)  # on the IOPub thread, which owns it

    def uninstall(self) -> None:
        for name in LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if self._pipe is not None:
            stream, handler = self._pipe
            self._pipe = None
            stream.io_loop.add_callback(stream.on_recv, handler)
