"""The answers of an endpoint's ``stream()`` call, in the order they arrive, to iterate with
``for`` or ``async for``.

Example::

    for fut in trainers.step.stream(3):
        print(fut.get())
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..runtime import Completion, Part, Runtime
from .future import Future


class Stream:
    """The answers of a ``stream()`` call as they arrive: a sync and an async iterator of
    settled Futures (each raises that rank's error, if any, when you ``get()`` it)."""

    def __init__(self, n: int, value: Callable[[Part], Any]):
        """``n`` answers to come; ``value``: an answer's value (it raises that rank's error)."""
        self._slots = [Completion() for _ in range(n)]
        self._arrived = 0
        self._next = 0  # the next slot iteration hands out
        self._lock = threading.Lock()
        self._value = value

    def arrived(self, part: Part) -> None:  # on the IO thread: the next slot in arrival order
        with self._lock:
            slot = self._slots[self._arrived]
            self._arrived += 1
        slot.set_result(part)

    def _future(self, part: Part) -> Future:
        value = self._value
        return _settled(lambda: value(part))

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Future:
        # Inside an async endpoint this blocks that actor's own worker, as in Monarch (it takes
        # one message at a time anyway); the answers arrive on the IO thread, which never waits.
        rt = Runtime.existing()
        if rt is not None and rt.io.is_current():
            raise RuntimeError("iterating a stream() on the IO thread would block it: "
                               "use `async for fut in ....stream(...)` instead")
        slot = self._take()
        while not slot.wait(0.1):  # in slices, so that an interrupt gets in
            pass
        return self._future(slot.result())

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Future:
        try:
            slot = self._take()
        except StopIteration:
            raise StopAsyncIteration from None
        return self._future(await slot)

    def _take(self) -> Completion:
        """The next answer's slot (one iteration, sync or async, takes each once)."""
        with self._lock:
            if self._next >= len(self._slots):
                raise StopIteration
            slot = self._slots[self._next]
            self._next += 1
        return slot

    def __len__(self) -> int:
        return len(self._slots)


def _settled(fn) -> Future:
    c = Completion()
    c.set_result(None)
    return Future(c, lambda _none: fn())
