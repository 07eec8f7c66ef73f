"""``Future``: the answer to a call.  ``.get(timeout=)`` blocks any thread; ``await`` works
in any asyncio loop (ipykernel cells, async endpoints, ``asyncio.run``).

Example::

    fut = trainers.step.call(3)
    meshed = fut.get(timeout=10)      # or: meshed = await fut
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from ..runtime import Completion, Runtime, in_actor_event_loop

R = TypeVar("R")
_UNSET = object()
FUTURE_NOT_BUILT = "Future objects are returned by Monarch operations and cannot be constructed directly."


def _run_coroutine(coro: Coroutine[Any, Any, Any], done: Completion) -> None:
    """Runs a coroutine on its own thread and event loop; ``done`` ends with it."""

    def run() -> None:
        try:
            done.set_result(asyncio.run(coro))
        except BaseException as e:  # the caller's get()/await raises it
            done.set_exception(e)

    threading.Thread(target=run, name="monarch-kernel-future", daemon=True).start()


class Future(Generic[R]):
    """The answer to an operation.  Some operations (RDMA transfers, as in Monarch) start
    only when their Future is first awaited or read: ``start`` begins them, once.

    Example::

        fut = trainers.step.call(8)
        values = fut.get(timeout=30)       # blocking, or: values = await fut
    """

    __slots__ = ("_completion", "_transform", "_value", "_error", "_lock", "_inbox", "_start")

    def __init__(self, completion: Completion | None = None,
                 transform: Callable[[Any], R] | None = None, inbox=None, *,
                 start: Callable[[], None] | None = None):
        # Monarch's Futures come only from its operations: ``Future()`` says so in Monarch's
        # words, and ``Future(coro=...)`` is refused as Monarch's is (an unexpected keyword).
        if completion is None:
            raise TypeError(FUTURE_NOT_BUILT)
        if not isinstance(completion, Completion):
            raise TypeError("Future.__init__() takes 1 positional argument but 2 were given")
        self._completion = completion
        self._inbox = inbox  # where the answer arrives; read by whoever waits
        self._transform = transform
        self._value: Any = _UNSET
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._start = start  # not None until the work behind a deferred Future has begun

    @classmethod
    def _from_coro(cls, coro: Coroutine[Any, Any, R]) -> Future[R]:
        """Monarch's private constructor: a Future of ``coro``, which runs (on a thread and
        event loop of its own) once the Future is first awaited or read."""
        if not asyncio.iscoroutine(coro):
            raise TypeError(f"Future._from_coro needs a coroutine, not {type(coro).__name__}")
        done = Completion()
        return cls(done, start=lambda: _run_coroutine(coro, done))

    def _begin(self) -> None:
        """Start the work of a deferred Future, the first time anyone waits for it."""
        if self._start is None:
            return
        with self._lock:
            start, self._start = self._start, None
        if start is not None:
            try:
                start()
            except BaseException as e:  # the work could not begin: its Future raises it
                self._completion.set_exception(e)

    @classmethod
    def ready(cls, value: R) -> Future[R]:
        c = Completion()
        c.set_result(value)
        return cls(c)

    def done(self) -> bool:
        return self._completion.done()

    def _finish(self) -> R:
        with self._lock:
            if self._value is _UNSET and self._error is None:
                try:
                    raw = self._completion.result()
                    self._value = self._transform(raw) if self._transform else raw
                except BaseException as e:
                    self._error = e
        if self._error is not None:
            raise self._error.with_traceback(None)
        return self._value

    def get(self, timeout: float | None = None) -> R:
        """Wait for the value (or raise the rank's error); ``TimeoutError`` after ``timeout`` s."""
        c = self._completion
        if not c.done():
            rt = Runtime.existing()
            if rt is not None and (rt.io.is_current() or in_actor_event_loop()):
                raise RuntimeError(
                    "cannot block on .get() inside an async endpoint or on the IO loop: "
                    "use `await fut` instead"
                )
            self._begin()
            if not (rt.wait_for(c, timeout, self._inbox) if rt is not None else c.wait(timeout)):
                raise TimeoutError(
                    f"no answer within {timeout} s (the call is still running; .get() again to keep waiting)")
        return self._finish()

    result = get

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def _watched(self) -> None:
        """Nobody will block on the inbox: let the IO thread read it."""
        if self._inbox is not None and not self._completion.done():
            Runtime.current().watch_inbox(self._inbox)

    def __await__(self):
        if not self._completion.done():
            self._begin()
            self._watched()
            yield from self._await().__await__()
        return self._finish()

    async def _await(self):
        try:
            await self._completion
        except BaseException:
            pass  # raised again, transformed, by _finish

    def map(self, fn: Callable[[R], Any]) -> Future:
        """A Future of ``fn(value)``, resolved when this one is (its error passes through)."""
        inner = self._transform

        def both(raw):
            return fn(inner(raw) if inner is not None else raw)

        return Future(self._completion, both, self._inbox, start=self._begin if self._start is not None else None)

    def then(self, fn: Callable[[Future[R]], None]) -> None:
        """Run ``fn(self)`` once done, on whichever thread finishes it."""
        self._completion.add_done_callback(lambda _c: fn(self))
        self._begin()
        self._watched()

    def __repr__(self) -> str:
        return f"<Future {'done' if self.done() else 'pending'}>"
