"""Runs in the controller: waiting until what its ranks have written has reached the output
hooks.  A rank's answer travels apart from its output and overtakes it, so a notebook cell
whose calls returned ends with their output only after this.  Every template and every
host's agent is asked at once to read its ranks' pipes dry and send it (``Drain``); each
answers ``Drained`` after the output, on the same channel."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def drain(io, sources: Callable[[], Iterable], timeout: float) -> bool:
    """(Not the IO thread) Ask each of ``sources()`` (templates and agent links with a
    ``drain(then)``, listed on the IO thread) and wait for all; False if some did not answer
    within ``timeout`` s."""
    done = threading.Event()
    left = [0]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    def ask() -> None:
        asked = list(sources())
        left[0] = len(asked) + 1
        for source in asked:
            source.drain(one_done)
        one_done()

    io.call_soon(ask)
    return done.wait(timeout)
