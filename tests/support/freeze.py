"""Freezing a rank with SIGSTOP, for tests that need one that cannot answer.

``kill(pid, SIGSTOP)`` returns before the process has stopped: the kernel stops a
process's threads only once one of them is scheduled to start the group stop, and on a
loaded machine the others (a rank's IO thread among them) may answer a request or two
first.  ``freeze`` returns once every thread of ``pid`` is stopped.
"""

from __future__ import annotations

import os
import signal
import time


def _states(pid: int) -> list[bytes]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                out.append(f.read().rsplit(b")", 1)[1].split()[0])
        except (OSError, IndexError):
            pass  # a thread that ended meanwhile
    return out


def freeze(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until all of its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = _states(pid)
        if states and all(s in (b"T", b"t") for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} not stopped {timeout:g} s after SIGSTOP: thread states {states}")
        time.sleep(0.01)


def thaw(pid: int) -> None:
    """SIGCONT ``pid`` (gone already is fine)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
