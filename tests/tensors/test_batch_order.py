"""``BatchOrder``'s bookkeeping against a real stream thread that runs its part of a batch
before the dispatching thread has counted it (fresh46: a ``KeyError`` on the stream's
thread, and every later request of the executor waited for ever)."""

from __future__ import annotations

import threading

import pytest

from monarch_kernel.tensors.rank.batch_order import BatchOrder
from monarch_kernel.tensors.rank.streams import Streams

pytestmark = pytest.mark.timeout(60)


class EagerStreams(Streams):
    """Streams whose ``mark`` returns only once the stream's thread has run the mark, or
    was held from it for half a second: the order the race needs, made likely."""

    def mark(self, fn, seq: int) -> int:
        finished = threading.Event()

        def watched(s):
            try:
                fn(s)
            finally:
                finished.set()

        n = super().mark(watched, seq)
        finished.wait(0.5)  # a correct BatchOrder holds the stream's thread until it has counted
        return n


def test_a_stream_that_runs_its_part_at_once_still_lets_the_batch_finish():
    streams = EagerStreams({}, 0)
    try:
        order = BatchOrder(streams)
        streams.switch((None, "side"))
        ran = []
        for seq in (1, 2):
            streams.current.put(ran.append, seq)  # this batch's part on the side stream
            order.run(seq, (seq,), lambda s: None)
        assert order.wait(2, timeout=30), "batch 2 never finished: a stream's mark was lost"
        assert ran == [1, 2] and order.done == 2
    finally:
        streams.close()
