"""Actors hosted in this process: one worker thread each for sync endpoints (so they never
block the IO loop), async endpoints on the IO loop.  Messages to one actor's sync endpoints
run one at a time, in arrival order.
"""

from __future__ import annotations

import inspect
import queue
import threading

from .completion import Completion
from .context import MeshRef

ENDPOINT_MARK = "__monarch_endpoint__"


class ActorSlot:
    def __init__(self, actor_id: str, mesh: MeshRef, rank: int):
        self.actor_id = actor_id
        self.mesh = mesh
        self.rank = rank
        self.instance = None
        self.constructed = Completion()  # result: None, or the failure raised by __init__
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._kinds: dict[str, bool] = {}
        self.stopped = False

    def submit(self, fn) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"actor-{self.actor_id}", daemon=True)
            self._thread.start()
        self._queue.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()

    def stop(self) -> None:
        self.stopped = True
        if self._thread is not None:
            self._queue.put(None)

    def endpoint(self, method: str):
        """Return ``(bound method, is_async)``; raises AttributeError naming the endpoints."""
        cls = type(self.instance)
        fn = getattr(cls, method, None)
        if fn is None or not getattr(fn, ENDPOINT_MARK, False):
            names = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), ENDPOINT_MARK, False))
            raise AttributeError(
                f"{cls.__qualname__} has no endpoint {method!r}; its endpoints are: "
                f"{', '.join(names) or '(none)'}. Mark methods with @endpoint."
            )
        is_async = self._kinds.get(method)
        if is_async is None:
            target = getattr(fn, "__wrapped__", fn)
            is_async = self._kinds[method] = inspect.iscoroutinefunction(target)
        return getattr(self.instance, method), is_async
