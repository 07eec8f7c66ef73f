"""The executor: one per rank and proc mesh, holding the rank's shard of every live
distributed tensor (ref -> tensor) and running the controller's batches in order.

An op that raises poisons its results with this rank's traceback, and whatever reads a
poisoned value is poisoned in turn; the executor itself never raises, so the rank stays
alive and later ops run.  Batches may arrive out of order: ``BatchOrder`` runs them in turn
and holds requests until the batches sent before them have run.  Used only once a tensor
exists, so it imports torch.
"""

from __future__ import annotations

import functools
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ...runtime import config
from ..messages import (
    BACKWARD,
    BORROW,
    COLLECTIVE,
    DELETE,
    DROP,
    GRAD,
    GRAD_MODE,
    GRADS,
    OP,
    PROMISE,
    RANKS,
    ROUTING,
    SET_ATTR,
    STREAM,
    Poisoned,
    Ref,
)
from .backward import LazyBackward
from .batch_order import BatchOrder
from .streams import Streams, current_stream
from .values import _running, _to_controller

_EXECUTORS: dict[str, Executor] = {}  # engine key -> this process's executor for it
_REGISTERED = threading.Condition()  # notified when an executor registers
_SEQ = (list, tuple)


class _PoisonedInput(Exception):
    def __init__(self, poisoned: Poisoned):
        self.poisoned = poisoned


def executor_for(key: str, timeout: float = 0.0) -> Executor | None:
    """This process's executor for engine ``key``, waiting up to ``timeout`` s for it to start."""
    with _REGISTERED:
        _REGISTERED.wait_for(lambda: key in _EXECUTORS, timeout)
        return _EXECUTORS.get(key)


def local_shard(key: str, ref: int, seq: int, timeout: float | None = None):
    """The local shard of a distributed tensor passed to an endpoint on these procs: found in
    this process's executor once the batch that made it has run (waits for it)."""
    timeout = _SHARD_TIMEOUT_S if timeout is None else timeout
    with _REGISTERED:  # the engine may still be starting (importing torch) on this rank
        if not _REGISTERED.wait_for(lambda: key in _EXECUTORS, timeout):
            raise RuntimeError("a distributed tensor reached a process that has no tensor engine for its mesh: "
                               "pass it only to actors spawned on the procs it lives on")
        ex = _EXECUTORS[key]
    return ex.shard(ref, seq, timeout)


class Executor:
    def __init__(self, rank: int, key: str, seed: int | None = None, store=None):
        self.rank = rank
        self.key = key
        self.store = store  # the Rendezvous reductions meet over (made by the controller)
        self.env: dict[int, Any] = {}
        self._cond = threading.Condition()  # notified when an endpoint binds what an rref promised
        self._selected = True  # whether this rank runs the ops that follow (RANKS)
        self._collectives: Any = None
        self.streams = Streams(self.env, rank)
        self.order = BatchOrder(self.streams)
        self.busy_s = 0.0  # time spent running ops
        self.ops = 0  # messages run
        table: dict[int, Callable[[tuple], None]] = {
            OP: self._op, BACKWARD: self._backward, SET_ATTR: self._set_attr, COLLECTIVE: self._collective,
            PROMISE: self._promise, GRADS: self._grads, GRAD: self._grad, GRAD_MODE: self._grad_mode,
            RANKS: self._ranks, DELETE: functools.partial(self.streams.delete, self._delete),
            STREAM: self.streams.switch, BORROW: self.streams.borrow, DROP: self.streams.drop}
        self._handlers = [table[kind] for kind in range(len(table))]  # indexed by a message's kind
        self._promised: set[int] = set()  # refs an actor's endpoint will bind (rref)
        if seed is not None:
            torch.manual_seed(seed)
        with _REGISTERED:
            _EXECUTORS[key] = self
            _REGISTERED.notify_all()

    def close(self) -> None:
        self.streams.close()
        for v in list(self.env.values()):
            if type(v) is LazyBackward:
                v.stop()
        self.env.clear()
        if self._collectives is not None:
            self._collectives.close()
        if _EXECUTORS.get(self.key) is self:
            del _EXECUTORS[self.key]

    # ------------------------------------------------------------ batches

    def run_batch(self, seq: int, payload: bytes, made: list[int]) -> None:
        """Run batch ``seq`` (pickled messages; ``made``: the refs its ops bind) once every
        earlier one has run."""
        self.order.run(seq, (payload, made), self._run)

    def _run(self, payload: bytes, made: list[int]) -> None:
        try:
            messages = pickle.loads(payload)
        except Exception as e:  # an op's function that this rank cannot import, say
            poison = Poisoned(self.rank, "loading a batch of ops", "".join(traceback.format_exception(e)))
            for ref in made:
                self.env[ref] = poison
            return
        handlers = self._handlers
        _running[0] = self
        start = time.perf_counter()
        to = self.streams.current
        selected = self._selected
        for m in messages:
            k = m[0]
            if k >= ROUTING:  # steers the dispatch: acts now
                handlers[k](m)
                to, selected = self.streams.current, self._selected
            elif not selected:
                pass
            elif to is None:  # the main stream: inline
                handlers[k](m)
            else:
                to.put_op(handlers[k], m)
        self.busy_s += time.perf_counter() - start
        self.ops += len(messages)

    # ------------------------------------------------------------ handlers

    def _op(self, m: tuple) -> None:
        _, func, args, kwargs, out, deep = m
        env = self.env
        try:
            if deep:
                args, kwargs = self._resolve((args, kwargs))
            else:  # the common case: refs only at the top level of args
                args = self._flat(args)
            result = func(*args, **kwargs)
        except _PoisonedInput as p:
            self._bind_poison(out, p.poisoned)
            return
        except Exception as e:
            self._bind_poison(out, self._poison(func, e))
            return
        if type(out) is int:
            env[out] = result
        else:
            self._bind(out, result)

    def _flat(self, args: tuple) -> list:
        env = self.env
        resolved = []
        for a in args:
            if type(a) is Ref:
                ref = a.id
                a = env.get(ref, _MISSING)
                if a is _MISSING:
                    a = self._missing(ref)
                if type(a) is Poisoned:
                    raise _PoisonedInput(a)
            resolved.append(a)
        return resolved

    def _missing(self, ref: int):
        """A ref not bound here: one an actor's endpoint promised waits for it (``rref``)."""
        if ref in self._promised:
            with self._cond:
                if self._cond.wait_for(lambda: ref in self.env, _PROMISE_TIMEOUT_S):
                    return self.env[ref]
            return Poisoned(self.rank, "rref", f"the actor's endpoint did not make its result within "
                                               f"{_PROMISE_TIMEOUT_S:g} s\n")
        raise KeyError("a distributed tensor that does not exist on this rank (it was made on other ranks of the "
                       "mesh, or already deleted)")

    def _resolve(self, obj):
        t = type(obj)
        if t is Ref:
            v = self.env.get(obj.id, _MISSING)
            if v is _MISSING:
                v = self._missing(obj.id)
            if type(v) is Poisoned:
                raise _PoisonedInput(v)
            return v
        if t in _SEQ:
            return t(self._resolve(x) for x in obj)
        if t is dict:
            return {k: self._resolve(v) for k, v in obj.items()}
        return obj

    def _bind(self, out, value) -> None:
        if out is None:
            return
        if type(out) is int:
            self.env[out] = value
            return
        if not isinstance(value, (list, tuple)) or len(value) != len(out):
            self._bind_poison(out, Poisoned(self.rank, "an op", f"it returned {type(value).__name__}, not the "
                                            f"{len(out)} results the controller expected\n"))
            return
        for o, v in zip(out, value, strict=True):
            self._bind(o, v)

    def _bind_poison(self, out, poisoned: Poisoned) -> None:
        if out is None:
            return
        if type(out) is int:
            self.env[out] = poisoned
            return
        for o in out:
            self._bind_poison(o, poisoned)

    def _poison(self, func, e: BaseException) -> Poisoned:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        module = getattr(func, "__module__", None)
        what = f"{module}.{name}" if module and module not in ("torch._C", "builtins") else name
        return Poisoned(self.rank, what, "".join(traceback.format_exception(e)))

    def _delete(self, m: tuple) -> None:
        env = self.env
        for ref in m[1]:
            v = env.pop(ref, None)
            if type(v) is LazyBackward:
                v.stop()
        if self._promised:
            self._promised.difference_update(m[1])

    def _grads(self, m: tuple) -> None:
        """A backward pass whose gradients ``GRAD`` asks for one at a time (``grad_generator``)."""
        _, session, roots, wrt, grad_roots = m
        try:
            roots, wrt, grad_roots = self._resolve((roots, wrt, grad_roots))
            self.env[session] = LazyBackward(roots, wrt, grad_roots)
        except _PoisonedInput as p:
            self.env[session] = p.poisoned
        except Exception as e:
            self.env[session] = self._poison(LazyBackward, e)

    def _grad(self, m: tuple) -> None:
        _, session, index, out = m
        s = self.env.get(session)
        if type(s) is not LazyBackward:
            self.env[out] = s if type(s) is Poisoned else Poisoned(self.rank, "grad_generator", "its backward pass "
                                                                   "was deleted before this gradient\n")
            return
        try:
            self.env[out] = s.get(index)
        except Exception as e:
            self.env[out] = self._poison(torch.autograd.grad, e)

    def _promise(self, m: tuple) -> None:
        with self._cond:
            self._promised.update(r for r in m[1] if r not in self.env)

    def fulfill(self, out, value=None, error: BaseException | None = None, what: str = "an endpoint") -> None:
        """From an actor's thread: bind what its endpoint returned (or its error) to the refs
        an ``rref`` promised."""
        with self._cond:
            if error is not None:
                self._bind_poison(out, Poisoned(self.rank, what, "".join(traceback.format_exception(error))))
            else:
                self._bind(out, value)
            self._cond.notify_all()

    def _grad_mode(self, m: tuple) -> None:
        torch.set_grad_enabled(m[1])

    def _ranks(self, m: tuple) -> None:
        self._selected = m[1] is None or self.rank in m[1]

    def _backward(self, m: tuple) -> None:
        _, loss, gradient, retain, binds = m
        grads = tuple(g for _p, g in binds)
        try:
            loss_t, g = self._resolve((Ref(loss), gradient))
            loss_t.backward(g, retain_graph=retain)
            for p, ref in binds:
                self.env[ref] = self._resolve(Ref(p)).grad
        except _PoisonedInput as p:
            self._bind_poison(grads, p.poisoned)
        except Exception as e:
            self._bind_poison(grads, self._poison(torch.Tensor.backward, e))

    def _set_attr(self, m: tuple) -> None:
        _, ref, name, value = m
        try:
            target, value = self._resolve((Ref(ref), value))
            setattr(target, name, value)
        except _PoisonedInput as p:
            self.env[ref] = p.poisoned
        except Exception as e:
            self.env[ref] = self._poison(setattr, e)

    def _collective(self, m: tuple) -> None:
        """Reductions and moves between meshes: handed to the rank's ``Collectives``."""
        request = m[1]
        try:
            if self._collectives is None:
                self._collectives = _load_collectives()(self)
            self._collectives.run(request, current_stream())
        except Exception as e:
            self._bind_poison(getattr(request, "out", None), self._poison(type(self._collectives or self), e))

    # ------------------------------------------------------------ values back to the controller

    def request(self, seq: int, fn, args, kwargs, reply: Callable[[Any], None]) -> None:
        """Answer ``fn(*args, **kwargs)`` (``fn`` None: ``args[0]``), refs resolved, once
        batch ``seq`` has run: ``reply`` gets the value (tensors detached, on the CPU) or a
        ``Poisoned``."""
        self.order.when_run(seq, lambda: reply(self._value(fn, args, kwargs)))

    def answer(self, seq: int, fn, args, kwargs, not_yet):
        """``request`` answered now: the value, or ``not_yet`` if batch ``seq`` has not run."""
        if seq > self.order.done:
            return not_yet
        return self._value(fn, args, kwargs)

    def _value(self, fn, args, kwargs):
        _running[0] = self
        try:
            args, kwargs = self._resolve((args, kwargs))
            value = args[0] if fn is None else fn(*args, **kwargs)
            return _to_controller(value)
        except _PoisonedInput as p:
            return p.poisoned
        except Exception as e:
            return self._poison(fn, e)

    def shard(self, ref: int, seq: int, timeout: float):
        """From any thread: the tensor at ``ref`` once batch ``seq`` has run."""
        if not self.order.wait(seq, timeout):
            raise TimeoutError(f"timed out after {timeout:g} s waiting for the tensor engine to make a "
                               "distributed tensor passed to this endpoint")
        v = self.env.get(ref, _MISSING)
        if type(v) is Poisoned:
            from ..errors import RemoteException

            raise RemoteException(v)
        if v is _MISSING:
            raise KeyError("the distributed tensor passed to this endpoint does not exist on this rank")
        return v

    def stats(self) -> dict:
        """Live refs on this rank, and the bytes their tensors hold."""
        n = nbytes = 0
        for v in list(self.env.values()):  # streams' threads may bind meanwhile
            if isinstance(v, torch.Tensor):
                n += 1
                nbytes += v.numel() * v.element_size()
        return {"refs": len(self.env), "tensors": n, "bytes": nbytes, "done": self.order.done, "ops": self.ops,
                "busy_s": self.busy_s}


_MISSING = object()
_PROMISE_TIMEOUT_S = config.seconds("tensor_promise_timeout")
_SHARD_TIMEOUT_S = config.seconds("tensor_shard_timeout")


def _load_collectives():
    from .requests import CollectiveRequests

    return CollectiveRequests

