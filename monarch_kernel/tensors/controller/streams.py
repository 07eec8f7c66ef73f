"""``Stream``, ``get_active_stream``, borrows, ``grad_generator`` and ``grad_function``, with
Monarch's names.

Ops recorded inside ``stream.activate()`` run on that stream on every rank: in order on the
stream, and at the same time as other streams' ops (``tensors/rank/streams.py``).  A tensor
belongs to the stream it was made on; another stream uses it through a borrow, which orders
the two: the borrower sees the lender's earlier writes, and after ``drop()`` the lender's
later ops see the borrower's.  The rules of use are checked here (``borrows.py``).

Example (DDP whose reductions overlap the backward pass)::

    comms = Stream("comms")
    with procs.activate():
        loss = model(x).sum()
        params = list(reversed(list(model.parameters())))
        with torch.no_grad():
            borrows = []
            for p, g in zip(params, grad_generator(loss, params)):
                g_c, borrow = comms.borrow(g, mutable=True)
                with comms.activate():
                    g_c.reduce_("gpus", "avg")      # overlaps the next gradient's backward
                borrows.append((p, g, borrow))
            for p, g, borrow in borrows:
                borrow.drop()
                p -= 0.1 * g
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings

import torch

from ..messages import BORROW, DROP, GRAD, GRADS
from ..rank.backward import custom_grad
from .borrows import DROPPED, Access, check_use, stream_name
from .meshes import active, mesh_of, no_mesh, state
from .recorder import _find
from .remote import _fakes, record_call
from .tensor import Tensor

_keys = itertools.count(1)


class BorrowWarning(UserWarning):
    """A borrow that was never dropped (it is dropped when it is garbage collected)."""


class Stream:
    """A stream of work on every rank (``Stream("comms")``): its ops run in order, and at
    the same time as other streams' ops.

    Example::

        comms = Stream("comms")
        with procs.activate():
            with comms.activate():
                total = monarch.reduce(grads, "gpus")   # runs beside the main stream
    """

    def __init__(self, name: str, _default: bool = False):
        self.name = name
        self.default = _default
        self.key = None if _default else f"{name}/{next(_keys)}"

    @contextlib.contextmanager
    def activate(self):
        """Record the ops of this block on this stream."""
        previous = state.stream
        state.stream = None if self.default else self
        try:
            yield self
        finally:
            state.stream = previous

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` for use on this stream: a handle on the same shards, and the ``Borrow`` to
        ``drop()`` once this stream is done with it.  ``mutable``: this stream may write to
        it, and ``t``'s own stream may not use it until the drop; else both may read it and
        neither may write."""
        if type(t) is not Tensor:
            raise TypeError(f"borrow takes a distributed tensor, not {type(t).__name__}")
        to = None if self.default else self
        if t._access is DROPPED:
            check_use(t, t._stream, "borrow()", False)
        if t._stream is to:
            raise ValueError(f"this tensor is on {stream_name(to)} already; borrow it for another stream")
        if t._access is not None and (mutable or t._access.mode == ""):
            kind = "mutably" if t._access.mode == "" else "read-only"
            raise RuntimeError(f"this tensor is borrowed {kind} already; a tensor borrowed mutably can have no other "
                            "borrow: drop that borrow first")
        mesh = t._mesh
        client = mesh.client
        ref = client.new_ref()
        previous, state.stream = state.stream, to
        try:
            h = Tensor(t._meta, mesh, ref)
        finally:
            state.stream = previous
        h._leaves = t._leaves
        client.adopt(h)
        client.record((BORROW, t._ref, ref, _key(t._stream), _key(to)), [ref], mesh.rank_set,
                      torch.is_grad_enabled())
        b = Borrow(t, h, mutable, to)
        if mutable:
            t._access = Access("")
        else:
            t._access = t._access or Access("r")
            h._access = Access("r")
            h._access.borrows.append(b)
        t._access.borrows.append(b)
        return h, b

    def __repr__(self) -> str:
        return f"<Stream {self.name!r}>"


def _key(stream) -> str | None:
    return None if stream is None else stream.key


class Borrow:
    """A tensor lent to another stream; ``drop()`` gives it back: the lender's later ops
    wait for the borrower's ops recorded before the drop, and the borrowed handle may not
    be used after it."""

    def __init__(self, lender: Tensor, handle: Tensor, mutable: bool, stream):
        self.lender: Tensor | None = lender
        self.handle: Tensor | None = handle
        self.mutable = mutable
        self.stream = stream  # the borrowing stream (None: the main one)

    def drop(self) -> None:
        t, h = self.lender, self.handle
        if t is None or h is None:
            return
        self.lender = self.handle = None
        msg = (DROP, h._ref, t._ref, self.mutable, _key(t._stream), _key(self.stream))
        t._mesh.client.record(msg, [], t._mesh.rank_set, torch.is_grad_enabled())
        self._give_back(t, h)

    def _give_back(self, t: Tensor, h: Tensor) -> None:
        h._access = DROPPED
        acc = t._access
        if acc is not None and self in acc.borrows:
            acc.borrows.remove(self)
            if not acc.borrows:
                t._access = None

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc) -> None:
        self.drop()

    def __del__(self):
        t, h = self.lender, self.handle
        if t is None or h is None:
            return
        warnings.warn("a borrow was garbage collected before borrow.drop(): it is dropped at the next batch, so "
                      "the lender's stream waits for the borrower there; call drop() where the borrower is done",
                      BorrowWarning, stacklevel=2)
        t._mesh.client.later.append((DROP, h._ref, t._ref, self.mutable, _key(t._stream), _key(self.stream)))
        self._give_back(t, h)


_default = Stream("main", _default=True)


def get_active_stream() -> Stream:
    """The stream ops are recorded on now (the main one outside any ``stream.activate()``).

    Example::

        with procs.activate():
            monarch.get_active_stream()         # the main stream
    """
    return state.stream or _default


def grad_generator(roots=(), with_respect_to=(), grad_roots=()):
    """The gradients of ``roots`` with respect to each of ``with_respect_to``, one at a
    time, in the order listed (list parameters last layer first, the order backward makes
    them).  On the ranks the backward pass runs only as far as each gradient asked for
    needs, so work recorded between two gradients (a reduction on a comms stream) overlaps
    the rest of the pass.

    Example::

        with procs.activate():
            for grad in monarch.grad_generator(loss, [w2, w1]):
                monarch.reduce_(grad, "gpus")       # each gradient as soon as it exists
    """
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    wrt = list(with_respect_to)
    grad_roots = list(grad_roots)
    if not any(type(t) is Tensor for t in (*roots, *wrt)):
        yield from torch.autograd.grad(roots, wrt, grad_roots or None, allow_unused=True)
        return
    mesh = next(t._mesh for t in (*roots, *wrt) if type(t) is Tensor)
    for t in (*roots, *wrt, *(g for g in grad_roots if g is not None)):
        if type(t) is not Tensor or not t._mesh.same(mesh):
            raise TypeError("grad_generator takes distributed tensors of one mesh (roots, with_respect_to and "
                            f"grad_roots), here of {mesh.describe()}")
    from .client import encode_value

    client = mesh.client
    stream = roots[0]._stream  # the backward runs where its forward did
    session = client.new_ref()
    grad = torch.is_grad_enabled()
    with _on(stream):
        client.record((GRADS, session, encode_value(roots), encode_value(wrt), encode_value(grad_roots) or None),
                      [session], mesh.rank_set, grad)
    try:
        for i, w in enumerate(wrt):
            with _on(stream):
                ref = client.new_ref()
                g = Tensor((*w._meta[:5], False), mesh, ref)
                client.adopt(g)
                client.record((GRAD, session, i, ref), [ref], mesh.rank_set, grad)
            yield g
    finally:
        client.dead.append(session)  # lock-free: this may run in a finalizer; it goes with the next batch


@contextlib.contextmanager
def _on(stream):
    previous, state.stream = state.stream, stream
    try:
        yield
    finally:
        state.stream = previous


def grad_function(fn):
    """A function with its own backward: ``fn(*args)`` returns ``(result, backward)``, where
    ``backward(*grad_outputs)`` returns the gradients of the arguments (one, or a tuple)::

        @grad_function
        def clip_grad(x):
            def backward(g):
                return g.clamp(-1, 1)
            return x.clone(), backward

    On distributed tensors inside ``activate()`` it runs on every rank, forward and
    backward, on the rank's shards (torch code there: no reductions or ``to_mesh`` inside)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        tensors, _deep = _find(args, kwargs)
        mesh = mesh_of(tensors) or active()  # its tensors' mesh first, as ops
        if mesh is None:
            return custom_grad(fn, *args, **kwargs)
        with no_mesh.activate(), torch.device("meta"):
            outputs = custom_grad(fn, *_fakes(args), **_fakes(kwargs))
        return record_call(mesh, functools.partial(custom_grad, fn), outputs, args, kwargs, autograd=True)

    return call
