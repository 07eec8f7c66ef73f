"""Actors hosted in this process: one worker thread each, which reads the actor's own
inbox and runs all of its endpoints, sync and async, one message at a time in arrival
order, as Monarch does (so thread-locals set in ``__init__`` are there in every endpoint,
and a call reaches the actor without passing through another thread).  Async endpoints run
on the worker's own event loop, which lives as long as the actor: the tasks they start
(``asyncio.create_task``, concurrent endpoints) run whenever the worker waits for its next
message, and are cancelled when the actor stops.  With no task alive the worker waits on
its inbox directly, so a sync endpoint's call never goes through the loop.

A slot is given what it uses: the network (its inbox), the receiver (reading it), the
rank's main thread (lent to one actor that asks) and the actors' lives' ``stop_spawned``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import inspect
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

import zmq
from zmq.backend import zmq_poll

from .. import config
from ..completion import Completion
from ..context import ActorContext, MeshRef, current_actor
from ..net.inbox import Inbox, actor_address

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..net.network import Network
    from ..net.receiver import Receiver
    from .main_thread import MainThread

log = logging.getLogger(__name__)
POLLIN = int(zmq.POLLIN)

ENDPOINT_MARK = "__monarch_endpoint__"
CONCURRENT_MARK = "__monarch_concurrent__"
STOP_METHOD = "__monarch_stop__"  # the message ActorMesh.stop() sends; never an endpoint's name
RESTART_HOOK = "__on_restart__"  # the hook the controller's healer calls after a restart, endpoint or not
CLEANUP_BUDGET_S = config.seconds("cleanup_budget")  # for what a stopping actor spawned
_in_loop = threading.local()  # .loop: the actor loop this thread is running now, if any


def in_actor_event_loop() -> bool:
    """Whether the calling thread is inside an async endpoint on its actor's event loop
    (where a blocking wait would stall the actor)."""
    return getattr(_in_loop, "loop", None) is not None


class ActorSlot:
    def __init__(self, actor_id: str, mesh: MeshRef, rank: int, network: Network, receiver: Receiver,
                 main_thread: MainThread | None, stop_spawned: Callable[[str, float], None]):
        """``main_thread``: the rank's, if this process is a rank; ``stop_spawned(actor id,
        timeout)``: stops what the actor spawned, as it stops (``ActorLives.stop_spawned``)."""
        self.actor_id = actor_id
        self.mesh = mesh
        self.rank = rank
        self.network = network
        self.receiver = receiver
        self.main_thread = main_thread
        self.stop_spawned = stop_spawned
        self.inbox: Inbox | None = None
        self.direct: str | None = None  # its own TCP address, on a rank on another host
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.instance = None
        self.constructed = Completion()  # result: None, or the failure raised by __init__
        self.init_started: float | None = None  # when __init__ itself began (its class loaded)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._soon: collections.deque = collections.deque()  # submit_soon's, run by whichever path first
        self._thread: threading.Thread | None = None
        self._ident: int | None = None  # the worker's thread id, once it runs
        self._kinds: dict[str, bool] = {}
        self.stopped = False
        self._busy = 0  # > 0 while user code of a sync endpoint runs on the worker
        self._busy_lock = threading.Lock()
        self.wants_main_thread = False  # the spawner asked for the rank's main thread
        self.init_failure: Any = None  # the Part __init__ answered with, if it raised
        self.failure: Any = None  # the Part that stopped it: an exception no caller received
        self._main: MainThread | None = None  # the MainThread it runs on, when it got it
        self.loop: asyncio.AbstractEventLoop | None = None  # the worker's own, made on the worker
        self._tasks: set = set()  # every task alive on its loop: endpoints' and those they started
        self.deferring = False  # an async endpoint runs: new calls wait in the queue
        self.halted = False  # its tasks were cancelled and __cleanup__ ran (or was tried)

    def submit(self, fn) -> None:
        """Run ``fn`` on this actor's worker, after what is already queued."""
        if self._thread is None:
            main = self.main_thread if self.wants_main_thread else None
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

    def submit_soon(self, fn) -> None:
        """Run ``fn`` on the worker soon: between messages, or while a running async
        endpoint awaits (on its loop), so that supervision never waits for the endpoint
        that may be waiting for it.  ``fn`` finds the loop running in the second case."""
        self._soon.append(fn)
        loop = self.loop
        if self.deferring and loop is not None:
            try:
                loop.call_soon_threadsafe(self._run_soon)
            except RuntimeError:
                pass  # its loop is closed: the actor stopped, the queue still runs it
        self.submit(self._run_soon)

    def _run_soon(self) -> None:
        while self._soon:
            try:
                fn = self._soon.popleft()
            except IndexError:
                return  # the other path took it
            fn()

    def is_current(self) -> bool:
        return threading.get_ident() == self._ident

    def run(self, coro) -> None:
        """On the worker: run one async endpoint to its end (its own task, so its context
        is its own); concurrent endpoints' tasks run meanwhile."""
        loop = self.loop
        assert loop is not None and self.is_current() and self.inbox is not None
        # Meanwhile answers from this call's subtree still reach the actor's inbox and are
        # merged; calls that arrive are queued behind this one (``deferring``).
        fds = self.inbox.fds()
        outer = self.deferring
        self.deferring = True
        for fd in fds:
            loop.add_reader(fd, self._read_meanwhile)
        _in_loop.loop = loop
        try:
            loop.run_until_complete(loop.create_task(coro))
        finally:
            _in_loop.loop = None
            for fd in fds:
                loop.remove_reader(fd)
            self.deferring = outer
        if self.inbox.ready():
            self.submit(lambda: None)  # a message came in while we ran: the worker looks again

    def _read_meanwhile(self) -> None:
        if self.inbox is not None and self.inbox.ready():
            self.receiver.read(self.inbox, 64, inline=True)

    def spawn(self, coro) -> None:
        """On the worker: start a concurrent endpoint; it runs whenever the worker waits."""
        assert self.loop is not None
        self.loop.create_task(coro)

    def _track(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        """The loop's task factory: every task made on it is known, so that the worker runs
        the loop while one is alive and the actor's stop cancels them all."""
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wait_for_work(self, watch) -> None:
        """Block until a message or a submitted function is there; while tasks are alive
        on the actor's loop, wait inside the loop so that they progress."""
        if not self._tasks:
            for what, _ev in zmq_poll(watch, -1):
                if what is self._wake_r:
                    os.read(self._wake_r, 4096)
            return
        loop = self.loop
        assert loop is not None and self.inbox is not None
        ready = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        fds = [*self.inbox.fds(), self._wake_r]
        for fd in fds:
            loop.add_reader(fd, wake)
        try:
            if self.inbox.ready() or not self._queue.empty():
                return
            _in_loop.loop = loop
            loop.run_until_complete(ready)
        finally:
            _in_loop.loop = None
            for fd in fds:
                loop.remove_reader(fd)
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def _work(self) -> None:
        self._ident = threading.get_ident()
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(self._track)
        os.set_blocking(self._wake_r, False)
        address = actor_address(self.mesh.addresses[self.rank], self.actor_id)
        # On a TCP rank the actor's inbox gets a port of its own, which its answers name
        # (``direct``); callers send there from then on, and through the rank's main inbox
        # (the IO thread hands those calls on) until they know it.
        self.inbox = self.network.actor_inbox(address)
        if address.startswith("tcp://"):
            self.direct = self.inbox.address
        inbox, work = self.inbox, self._queue
        read = self.receiver.read
        watch = [*inbox.items, (self._wake_r, POLLIN)]
        while True:
            while not work.empty():
                fn = work.get_nowait()
                if fn is None:
                    self._close()
                    return
                fn()
            # One message at a time: the wait below returns at once while more are waiting,
            # so each message costs one poll and one receive.
            if self._tasks:
                if inbox.ready():
                    with inbox.lease:
                        if work.empty():
                            read(inbox, 64, inline=True)
                    continue
                self._wait_for_work(watch)
                continue
            ready = zmq_poll(watch, -1)
            if not ready:
                continue
            if len(ready) > 1 or ready[0][0] is self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if ready[0][0] is not self._wake_r:  # the inbox's sockets come first in ``watch``
                with inbox.lease:
                    # While __init__ ran the IO thread read this inbox too (``construct``): what
                    # it read is queued, and goes first.
                    if work.empty():
                        read(inbox, 1, inline=True)

    def _close(self) -> None:
        """The actor stopped: its tasks are cancelled, then its loop closed."""
        loop = self.loop
        if loop is not None:
            self._cancel_tasks(loop)
            loop.close()
        if self.inbox is not None:
            self.inbox.close()
        if self._main is not None:
            self._main.release(self)

    def _cancel_tasks(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel every task on the actor's loop and let them end, for ``cleanup_budget`` at most."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        done, _ = loop.run_until_complete(asyncio.wait(tasks, timeout=CLEANUP_BUDGET_S))
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved: what a cancelled task raised is not worth a warning

    def halt(self, exc: BaseException | None) -> None:
        """On the worker: the actor stops, as Monarch's does.  The tasks on its loop are
        cancelled (the callers of its concurrent endpoints hear of it; one that ignores it is
        left after ``cleanup_budget``), the meshes it spawned are stopped
        (``ActorLives.stop_spawned``), then ``__cleanup__(exc)`` runs, sync or async;
        what it raises is reported on stderr, never raised.  Then the instance is let go of,
        so the actor's own finalizers can run.  Once only."""
        if self.halted:
            return
        self.halted = True
        loop = self.loop
        if loop is not None and not loop.is_running():
            self._cancel_tasks(loop)
        else:
            for t in list(self._tasks):
                t.cancel()
        # What it spawned stops with it (the calls its __cleanup__ makes to others still go).
        self.stop_spawned(self.actor_id, CLEANUP_BUDGET_S)
        obj, self.instance = self.instance, None
        fn = getattr(obj, "__cleanup__", None) if obj is not None else None
        if fn is None:
            return
        token = current_actor.set(ActorContext(self.mesh, self.rank, self.actor_id, obj, self.rank, self.mesh.dims))
        try:
            with self.running():
                result = fn(exc)
                if inspect.isawaitable(result):
                    if loop is None or loop.is_running():
                        raise RuntimeError("an async __cleanup__ cannot run here: the actor's loop is busy")
                    _in_loop.loop = loop
                    try:
                        loop.run_until_complete(result)
                    finally:
                        _in_loop.loop = None
        except BaseException:  # noqa: BLE001  (user code: the stop must go on; the rank's stderr reaches the controller)
            log.error("monarch_kernel: __cleanup__ of %s '%s' on rank %s raised:", type(obj).__qualname__,
                      self.actor_id, self.rank, exc_info=True)
        finally:
            current_actor.reset(token)

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

    def enter(self) -> None:
        """``running()`` without a context manager, for the hot path: call ``leave()`` after."""
        with self._busy_lock:
            self._busy += 1

    def leave(self) -> None:
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
        is_async = self._kinds.get(method)
        if is_async is not None:  # an endpoint already called: its class has not changed
            return getattr(self.instance, method), is_async
        cls = type(self.instance)
        fn = getattr(cls, method, None)
        if fn is None or not (getattr(fn, ENDPOINT_MARK, False) or method == RESTART_HOOK):
            names = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), ENDPOINT_MARK, False)
                           and not n.startswith("__monarch_"))  # the Actor base class's own (rref)
            raise AttributeError(
                f"{cls.__qualname__} has no endpoint {method!r}; its endpoints are: "
                f"{', '.join(names) or '(none)'}. Mark methods with @endpoint."
            )
        is_async = self._kinds.get(method)
        if is_async is None:
            target = getattr(fn, "__wrapped__", fn)
            is_async = self._kinds[method] = inspect.iscoroutinefunction(target)
        return getattr(self.instance, method), is_async
