"""A one-shot, thread-safe result slot: the runtime fills it, any thread or loop waits on it.

The IO thread sets results; callers block on ``wait`` (a bare lock, the cheapest wake-up
Python has) or await it from any asyncio loop.  It must never run user callbacks while
holding its lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

_PENDING = object()


class Completion:
    __slots__ = ("_lock", "_value", "_error", "_callbacks", "_guard")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Completion], None]] | None = []
        self._guard = threading.Lock()

    def done(self) -> bool:
        return self._callbacks is None

    def set_result(self, value: Any) -> bool:
        return self._finish(value, None)

    def set_exception(self, error: BaseException) -> bool:
        return self._finish(None, error)

    def _finish(self, value, error) -> bool:
        with self._guard:
            if self._callbacks is None:
                return False
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        for cb in callbacks:
            cb(self)
        return True

    def add_done_callback(self, cb: Callable[[Completion], None]) -> None:
        with self._guard:
            if self._callbacks is not None:
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self, timeout: float | None = None) -> bool:
        if self._callbacks is None:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            self._lock.release()
            return True
        return False

    def result(self) -> Any:
        """Value or raise; only valid once done."""
        if self._error is not None:
            raise self._error
        return self._value

    def error(self) -> BaseException | None:
        return self._error

    def __await__(self):
        if not self.done():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def wake(_c, fut=fut, loop=loop):
                def settle():
                    if not fut.done():
                        fut.set_result(None)

                if loop.is_closed():
                    return
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:
                    settle()
                else:
                    loop.call_soon_threadsafe(settle)

            self.add_done_callback(wake)
            yield from fut.__await__()
        return self.result()
