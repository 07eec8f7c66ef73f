"""The streams of one rank's executor: the main stream runs inline, on the thread that
dispatches the controller's batches; every other ``Stream`` runs on a thread of its own
(and, where CUDA is in use, on a CUDA stream of its own), so a reduction on a comms stream
overlaps the main stream's compute.

Ops on one stream run in the order they were recorded.  Across streams the only order is
what borrows give: a borrowed tensor is used on its new stream only once its own stream has
reached the borrow, and after ``drop()`` its own stream goes on only once the borrowing one
has reached the drop.  It must never reorder a stream's own work, and never let a stream's
thread raise (handlers poison results instead).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ...runtime import config
from ..messages import Poisoned

log = logging.getLogger(__name__)
_local = threading.local()


def current_stream() -> str:
    """The name of the stream the calling thread runs ("default": the main one); its
    collectives use process groups of their own."""
    return getattr(_local, "stream", "default")


class Signal:
    """A point in one stream's work that another stream waits for (a CUDA event too, once
    CUDA is in use, so the waiting stream's kernels follow the signalling one's)."""

    __slots__ = ("event", "cuda", "__weakref__")

    def __init__(self):
        self.event = threading.Event()
        self.cuda: Any = None

    def set(self, _arg=None) -> None:
        if torch.cuda.is_initialized():
            self.cuda = torch.cuda.Event()
            self.cuda.record()
        self.event.set()

    def wait(self, _arg=None) -> None:
        self.event.wait()
        if self.cuda is not None:
            torch.cuda.current_stream().wait_event(self.cuda)


class Worker:
    """One non-main stream: a thread running what is put on it, in order."""

    def __init__(self, key: str):
        self.key = key
        self.grad = True  # the grad mode its thread is in once what was put on it has run
        self.dirty = False  # something was put on it since its last mark
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"monarch-kernel-stream-{key}", daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[Any], None], arg) -> None:
        self.dirty = True
        self._queue.put((fn, arg))

    def put_op(self, fn: Callable[[Any], None], m) -> None:
        """An op, in the grad mode the dispatching (main) thread is in now."""
        grad = torch.is_grad_enabled()
        if grad is not self.grad:
            self._queue.put((torch.set_grad_enabled, grad))
            self.grad = grad
        self.put(fn, m)

    def mark(self, fn: Callable[[Any], None], seq: int) -> bool:
        """``fn(seq)`` once what was put so far has run; False (nothing put) if there was nothing new."""
        if not self.dirty:
            return False
        self.dirty = False
        self._queue.put((fn, seq))
        return True

    def _loop(self) -> None:
        _local.stream = self.key
        if torch.cuda.is_available():
            torch.cuda.set_stream(torch.cuda.Stream())
        get = self._queue.get
        while True:
            fn, arg = get()
            if fn is None:
                return
            try:
                fn(arg)
            except Exception:  # noqa: BLE001  (handlers poison; this is a bug, and the stream must go on)
                log.exception("stream %s: a tensor engine handler raised", self.key)

    def stop(self) -> None:
        self._queue.put((None, None))


class _Countdown:
    """A delete that every stream must reach first (the last one to reach it deletes)."""

    __slots__ = ("left", "lock", "fn", "m")

    def __init__(self, n: int, fn, m):
        self.left, self.lock, self.fn, self.m = n, threading.Lock(), fn, m

    def arrive(self, _arg=None) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.fn(self.m)


class Streams:
    """The workers of one executor, and the routing of borrows, drops and deletes between
    them and the main stream.  ``current``: the worker the ops being dispatched go to
    (None: the main stream, inline)."""

    def __init__(self, env: dict, rank: int):
        self.env, self.rank = env, rank
        self.workers: dict[str, Worker] = {}
        self.current: Worker | None = None
        self._signals: weakref.WeakSet = weakref.WeakSet()

    def switch(self, m: tuple) -> None:
        """``STREAM``: the ops that follow go to stream ``m[1]`` (None: the main one)."""
        self.current = None if m[1] is None else self._worker(m[1])

    def _worker(self, key: str) -> Worker:
        w = self.workers.get(key)
        if w is None:
            w = self.workers[key] = Worker(key)
        return w

    def _on(self, key: str | None, fn, arg) -> None:
        if key is None:
            fn(arg)
        else:
            self._worker(key).put(fn, arg)

    def borrow(self, m: tuple) -> None:
        _, src, new, from_key, to_key = m
        sig = self._signal()
        self._on(from_key, sig.set, None)
        self._on(to_key, self._take, (sig, src, new))

    def _take(self, arg) -> None:
        sig, src, new = arg
        sig.wait()
        v = self.env.get(src)
        self.env[new] = v if v is not None else Poisoned(self.rank, "borrow", "the borrowed tensor does not exist "
                                                                              "on this rank (it was deleted)\n")

    def drop(self, m: tuple) -> None:
        _, new, src, mutable, from_key, to_key = m
        sig = self._signal()
        self._on(to_key, self._give_back, (sig, new, src, mutable))
        self._on(from_key, sig.wait, None)

    def _give_back(self, arg) -> None:
        sig, new, src, mutable = arg
        v = self.env.pop(new, None)
        if mutable and type(v) is Poisoned:  # the borrower failed while it could write: so did the lender's value
            self.env[src] = v
        sig.set()

    def delete(self, fn, m) -> None:
        """``fn(m)`` once every stream has run what was put on it before."""
        if not self.workers:
            fn(m)
            return
        cd = _Countdown(len(self.workers) + 1, fn, m)
        for w in self.workers.values():
            w.put(cd.arrive, None)
        cd.arrive()

    def mark(self, fn, seq: int) -> int:
        """``fn(seq)`` on every worker with new work, once it has run it: how many."""
        return sum(w.mark(fn, seq) for w in self.workers.values())

    def _signal(self) -> Signal:
        s = Signal()
        self._signals.add(s)
        return s

    def close(self) -> None:
        for s in list(self._signals):  # nothing waits for ever on a stream that will not come
            s.event.set()
        for w in self.workers.values():
            w.stop()
        for w in self.workers.values():
            w.thread.join(timeout=config.seconds("tensor_stream_join"))
        self.workers.clear()
