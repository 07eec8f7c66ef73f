"""Bytes that are not Jupyter's wire format, sent to the kernel's own Jupyter ports (a port
scanner, a stray client, the chaos run's garbage): counted, and said in one line at most
every ``EVERY_S`` seconds instead of a traceback per frame.

ipykernel (7.x) splits a frame's identities from its message before its own ``try``, and
its IOPub socket reads a subscription's first byte without checking that there is one; so
each such frame raises in a ZMQ stream's callback, and tornado logs the traceback to the
kernel's stderr, which is the running cell's.  A burst of garbage made thousands of lines
there, in pieces that split the rank output printed beside them.  The frames are dropped
either way (the kernel goes on); this filter only changes what is said about them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback

LOGGERS = ("tornado.general", "tornado.application", "asyncio")  # where ZMQ streams' callbacks' errors go
EVERY_S = 10.0
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
    """Installed on tornado's loggers in the kernel process: ``counts`` (reason -> frames)."""

    def __init__(self, every: float = EVERY_S):
        super().__init__()
        self.every = every
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._said_at = -float("inf")
        self._said_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        why = _reason(record)
        if why is None:
            return True
        now = time.monotonic()
        with self._lock:
            self.counts[why] += 1
            total = sum(self.counts.values())
            if now - self._said_at < self.every:
                return False
            new, self._said_at, self._said_total = total - self._said_total, now, total
        record.msg = ("monarch-kernel: dropped %d malformed frame(s) on this kernel's Jupyter ports (%s; %d in all "
                      "since the kernel started); something other than a Jupyter client is connecting to them")
        record.args = (new, why, total)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True

    def install(self) -> PortGuard:
        for name in LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def uninstall(self) -> None:
        for name in LOGGERS:
            logging.getLogger(name).removeFilter(self)
