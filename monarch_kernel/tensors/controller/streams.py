"""``Stream``, ``get_active_stream``, borrows, and ``grad_generator``, with Monarch's names.

Every rank runs one ordered stream of work here: ops recorded on any ``Stream`` run in the
order they were recorded, so each of Monarch's ordering guarantees (a borrow sees the
lender's earlier writes; the lender's later ops wait for ``drop()``) holds, without the
overlap of communication and compute that separate streams would allow.

Example::

    comms = Stream("comms")
    with procs.activate():
        for g in grad_generator(loss, params):
            g_c, borrow = comms.borrow(g, mutable=True)
            with comms.activate():
                g_c.reduce_("gpus", "avg")
            borrow.drop()
"""

from __future__ import annotations

import contextlib

import torch

from ..rank.executor import gradients
from .meshes import no_mesh
from .recorder import rebind_on
from .remote import record_call
from .tensor import Tensor, fake_of


class Stream:
    """A named stream of work on every rank (``Stream("comms")``)."""

    def __init__(self, name: str, _default: bool = False):
        self.name = name
        self.default = _default

    @contextlib.contextmanager
    def activate(self):
        """Record the ops of this block on this stream."""
        previous = _active[0]
        _active[0] = self
        try:
            yield self
        finally:
            _active[0] = previous

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` for use on this stream: a handle on the same shards, and the ``Borrow`` to
        ``drop()`` once this stream is done with it."""
        if type(t) is not Tensor:
            raise TypeError(f"borrow takes a distributed tensor, not {type(t).__name__}")
        handle = rebind_on(t, t._mesh, t._mesh)
        return handle, Borrow(handle, mutable)

    def __repr__(self) -> str:
        return f"<Stream {self.name!r}>"


class Borrow:
    """A tensor lent to another stream; ``drop()`` gives it back (the borrowed handle may not
    be used after)."""

    def __init__(self, handle: Tensor, mutable: bool):
        self.handle: Tensor | None = handle
        self.mutable = mutable

    def drop(self) -> None:
        self.handle = None

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc) -> None:
        self.drop()


_default = Stream("main", _default=True)
_active: list[Stream] = [_default]


def get_active_stream() -> Stream:
    return _active[0]


def grad_generator(roots=(), with_respect_to=(), grad_roots=()):
    """The gradients of ``roots`` with respect to each of ``with_respect_to``, one at a time
    (Monarch's order: as listed), each a distributed tensor when they are."""
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    wrt = list(with_respect_to)
    grad_roots = list(grad_roots) or None
    if not any(type(t) is Tensor for t in (*roots, *wrt)):
        yield from torch.autograd.grad(roots, wrt, grad_roots, allow_unused=True)
        return
    mesh = next(t._mesh for t in (*roots, *wrt) if type(t) is Tensor)
    with no_mesh.activate():
        fakes = tuple(fake_of(t).detach() for t in wrt)
    yield from record_call(mesh, gradients, fakes, (roots, wrt, grad_roots), {})
