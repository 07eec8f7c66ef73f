"""Actors hosted in this process: one worker thread each, which reads the actor's own
inbox and runs its sync endpoints (so they never block the IO loop, and a call reaches
them without passing through another thread); async endpoints run on the IO loop.
Messages to one actor's sync endpoints run one at a time, in arrival order.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import queue
import threading

import zmq
from zmq.backend import zmq_poll

from .completion import Completion
from .context import MeshRef
from .inbox import Inbox, actor_address

POLLIN = int(zmq.POLLIN)

ENDPOINT_MARK = "__monarch_endpoint__"


class ActorSlot:
    def __init__(self, actor_id: str, mesh: MeshRef, rank: int, runtime):
        self.actor_id = actor_id
        self.mesh = mesh
        self.rank = rank
        self.runtime = runtime
        self.inbox: Inbox | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.instance = None
        self.constructed = Completion()  # result: None, or the failure raised by __init__
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._kinds: dict[str, bool] = {}
        self.stopped = False
        self._busy = 0  # > 0 while user code of a sync endpoint runs on the worker
        self._busy_lock = threading.Lock()
        self.wants_main_thread = False  # the spawner asked for the rank's main thread
        self.init_failure = None  # the Part __init__ answered with, if it raised
        self._main = None  # the MainThread it runs on, when it got it

    def submit(self, fn) -> None:
        """Run ``fn`` on this actor's worker, after what is already queued."""
        if self._thread is None:
            main = self.runtime.main_thread if self.wants_main_thread else None
            if main is not None and main.claim(self):
                self._main, self._thread = main, main.thread
                main.start(self._work)
            else:
                self._thread = threading.Thread(target=self._work, name=f"actor-{self.actor_id}", daemon=True)
                self._thread.start()
        self._queue.put(fn)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already signalled, or stopping

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _work(self) -> None:
        rt = self.runtime
        self.inbox = Inbox(rt.ctx, actor_address(self.mesh.addresses[self.rank], self.actor_id))
        watch = [(self.inbox.sock, POLLIN), (self._wake_r, POLLIN)]
        while True:
            while True:
                try:
                    fn = self._queue.get_nowait()
                except queue.Empty:
                    break
                if fn is None:
                    self.inbox.close()
                    if self._main is not None:
                        self._main.release(self)
                    return
                fn()
            for what, _ev in zmq_poll(watch, -1):
                if what is self._wake_r:
                    os.read(self._wake_r, 4096)
                else:
                    with self.inbox.lease:
                        rt._read(self.inbox, 64, inline=True)

    @contextlib.contextmanager
    def running(self):
        """Marks the worker as running user code (the only time it may be interrupted)."""
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1

    def busy(self) -> bool:
        """Whether user code of a sync endpoint is running on the worker now."""
        return self._busy > 0

    def interrupt(self) -> bool:
        """Raise KeyboardInterrupt in the user code running on the worker, if any.

        On the rank's main thread it is a SIGINT, which cuts a blocking call short; on
        other threads it lands at the next bytecode boundary, so a call blocked in C
        (``time.sleep``) sees it when that call returns.
        """
        with self._busy_lock:
            if not self._busy or self._thread is None or self._thread.ident is None:
                return False
            if self._main is not None:
                self._main.interrupt()
                return True
            return ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread.ident), ctypes.py_object(KeyboardInterrupt)) == 1

    def stop(self) -> None:
        self.stopped = True
        if self._thread is not None:
            self.submit(None)

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
