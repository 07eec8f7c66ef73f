"""What the controller sends an executor, and what comes back for a failed value.

A batch is a list of tuples whose first item is one of the kinds below; distributed
tensors inside an op's arguments travel as ``Ref``.  Pure data: no torch at import, and
both halves import it.
"""

from __future__ import annotations

# Kinds below ``ROUTING`` run on a stream (the main one inline, others on their own thread);
# the rest steer the dispatch itself and act at once, in the order they arrive.
OP = 0  # (OP, func, args, kwargs, out, deep): out is a ref, a tuple of outs, or None
BACKWARD = 1  # (BACKWARD, loss ref, gradient ref or None, retain_graph, [(param ref, grad ref), ...])
SET_ATTR = 2  # (SET_ATTR, ref, name, value): value a Ref, None or a constant
COLLECTIVE = 3  # (COLLECTIVE, request): handed to the rank's Collectives (reductions, to_mesh)
PROMISE = 4  # (PROMISE, [ref, ...]): refs an actor's endpoint will bind (``rref``); ops reading them wait
GRADS = 5  # (GRADS, session ref, roots, wrt, grad_roots): a backward pass, run lazily (``grad_generator``)
GRAD = 6  # (GRAD, session ref, index, out ref): run that backward until gradient ``index`` exists
ROUTING = 7
GRAD_MODE = 7  # (GRAD_MODE, enabled)
RANKS = 8  # (RANKS, frozenset of ranks or None): which ranks run the ops that follow
DELETE = 9  # (DELETE, [ref, ...]): after every stream has run what was sent before it
STREAM = 10  # (STREAM, key or None): the stream the ops that follow run on (None: the main one)
BORROW = 11  # (BORROW, src ref, new ref, from key, to key): ``to`` sees ``src`` once ``from`` reached here
DROP = 12  # (DROP, new ref, src ref, mutable, from key, to key): ``from`` goes on once ``to`` reached here


class Ref:
    """A distributed tensor inside a message: its id on the ranks."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self):
        return (Ref, (self.id,))

    def __repr__(self) -> str:
        return f"Ref({self.id})"


class Poisoned:
    """The value of a ref whose op failed on a rank (or read a poisoned input): the rank's
    traceback, kept until the ref is deleted and raised by whoever fetches it."""

    __slots__ = ("rank", "what", "traceback")

    def __init__(self, rank: int, what: str, traceback: str):
        self.rank, self.what, self.traceback = rank, what, traceback

    def __reduce__(self):
        return (Poisoned, (self.rank, self.what, self.traceback))

    def __repr__(self) -> str:
        return f"<poisoned on rank {self.rank} by {self.what}>"


class Collective:
    """A ``COLLECTIVE`` message's request, for the rank's ``Collectives``: ``kind``
    ("reduce" or "to_mesh"), the input ref ``source`` and output ref ``out`` (the same for
    an in-place reduce), the mesh (``labels``, ``sizes``, row-major ``ranks``), the ``dims``
    reduced over, ``reduction`` and ``scatter``; for to_mesh, ``dest_ranks`` (the other
    mesh's ranks, row-major, same dims); ``like``: the input's (shape, dtype), for a rank
    whose input failed (it still takes part, so its peers hear of the failure at once)."""

    __slots__ = ("kind", "source", "out", "labels", "sizes", "ranks", "dims", "reduction", "scatter", "dest_ranks",
                 "like")

    def __init__(self, kind: str, source: int, out: int, labels: tuple, sizes: tuple, ranks: tuple,
                 dims: tuple = (), reduction: str = "sum", scatter: bool = False, dest_ranks: tuple = (),
                 like: tuple | None = None):
        self.kind, self.source, self.out = kind, source, out
        self.labels, self.sizes, self.ranks = labels, sizes, ranks
        self.dims, self.reduction, self.scatter, self.dest_ranks = dims, reduction, scatter, dest_ranks
        self.like = like  # (shape, dtype): what a to_mesh destination receives, or a reduce's input

    def __reduce__(self):
        return (Collective, (self.kind, self.source, self.out, self.labels, self.sizes, self.ranks, self.dims,
                             self.reduction, self.scatter, self.dest_ranks, self.like))
