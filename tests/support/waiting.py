"""Waiting on a condition with a deadline, for checks whose answer may be a DataFrame (whose
truth is ambiguous) or a count: ``until`` takes None, False and 0 for "not yet", numpy's
too (a comparison of a DataFrame's cell, ``df["hi"][0] == 7999``, is numpy's False)."""

from __future__ import annotations

import time


def until(what: str, check, timeout: float = 30.0):
    """``check()``'s first answer that is not None, False or 0; fails saying ``what`` was
    waited for once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if not _not_yet(got):
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.1)


def _not_yet(got) -> bool:
    if got is None or got is False or (isinstance(got, int) and got == 0):
        return True
    # numpy's scalars (no dimensions): its False and zeros
    return type(got).__module__ == "numpy" and getattr(got, "shape", None) == () and not got
