"""``Accumulator``: fold the answers of one endpoint call over a mesh into a single value.

Example::

    total = Accumulator(counters.value, 0, operator.add).accumulate().get()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..runtime import Completion
from .adverbs import Endpoint
from .future import Future

A = TypeVar("A")
R = TypeVar("R")


class Accumulator(Generic[R, A]):
    """``Accumulator(endpoint, identity, combine)``: ``accumulate(*args)`` calls the
    endpoint on every rank of its mesh and folds the answers, in rank order, with
    ``combine(acc, value)`` starting from ``identity``.

    Example::

        acc = Accumulator(counters.value, 0, lambda total, v: total + v)
        total = acc.accumulate().get()        # the sum over every rank
    """

    def __init__(self, endpoint: Endpoint, identity: A, combine: Callable[[A, R], A]):
        if not callable(combine):
            raise TypeError(f"combine must be a function of (accumulated, value), not {type(combine).__name__}")
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """A Future of the folded value; it raises what any rank (or ``combine``) raised."""
        answers = self._endpoint.call(*args, **kwargs)
        arrived = Completion()

        def landed(fut: Future) -> None:  # on the IO thread: no user code here
            arrived.set_result(fut)

        answers.then(landed)

        def fold(fut: Future) -> A:
            value = self._identity
            for v in fut.get().values():
                value = self._combine(value, v)
            return value

        return Future(arrived, fold)
