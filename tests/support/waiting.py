"""Waiting on a condition with a deadline, for checks whose answer may be a DataFrame (whose
truth is ambiguous) or a count: ``until`` takes None, False and 0 for "not yet"."""

from __future__ import annotations

import time


def until(what: str, check, timeout: float = 30.0):
    """``check()``'s first answer that is not None, False or 0; fails saying ``what`` was
    waited for once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None and got is not False and not (isinstance(got, int) and got == 0):
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.1)
