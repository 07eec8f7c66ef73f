"""``TensorEngine``: the actor on every rank of a proc mesh that holds the rank's executor.
Batches come one-way (``run``); values go back as answers (``request``,
``run_and_request``), or through an explicit response port when a request overtook an
earlier batch, so that it waits on the rank, not on the controller.  ``keep_result`` is
an ``rref``'s other half: the endpoint's result kept here as distributed tensors.

Spawned lazily, once per proc mesh, by the controller's ``EngineBackend``
(``controller/backend.py``) on the first ``procs.activate()``.
"""

from __future__ import annotations

from ...actor.actor import Actor, current_rank
from ...actor.endpoint import endpoint

# What a request answers when it overtook the batch it must follow (batches go down the tree,
# requests straight to a rank): the controller asks again, and then the rank waits for it.
NOT_YET = "__monarch_kernel_tensor_not_yet__"


class TensorEngine(Actor):
    """Holds this rank's executor (the shards of every live distributed tensor)."""

    def __init__(self, key: str, store=None):
        from .executor import Executor

        rank = current_rank().rank
        self.executor = Executor(rank, key, seed=rank, store=store)

    @endpoint
    def run(self, seq: int, payload: bytes, made: list) -> None:
        self.executor.run_batch(seq, payload, made)

    @endpoint
    def request(self, seq: int, fn, args, kwargs):
        return self.executor.answer(seq, fn, args, kwargs, NOT_YET)

    @endpoint
    def run_and_request(self, seq: int, payload: bytes, made: list, fn, args, kwargs):
        """``run`` then ``request``, in one message: a fetch right after its ops."""
        self.executor.run_batch(seq, payload, made)
        return self.executor.answer(seq, fn, args, kwargs, NOT_YET)

    @endpoint(explicit_response_port=True)
    def request_later(self, port, seq: int, fn, args, kwargs) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint
    def send_to(self, seq: int, fn, args, kwargs, port) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint
    def stats(self, seq: int):
        return self.executor.answer(seq, self.executor.stats, (), {}, NOT_YET)

    def __cleanup__(self, exc) -> None:
        self.executor.close()


def engine_stats():
    """This rank's executor stats (refs, bytes, ops, busy_s): what ``EngineBackend.stats``
    asks every rank, after the batches before it."""
    from .values import current_stats

    return current_stats()


def keep_result(actor, key: str, method: str, out, args, kwargs) -> None:
    """On a rank (``Actor.__monarch_rref__``): run ``method`` and bind its result to ``out``
    in the tensor engine's executor."""
    import asyncio
    import inspect

    from .executor import executor_for

    ex = executor_for(key, timeout=60.0)
    if ex is None:
        raise RuntimeError("rref: this process has no tensor engine for the mesh (activate the actors' procs)")
    fn = getattr(type(actor), method)
    fn = getattr(fn, "__wrapped__", fn)
    try:
        value = fn(actor, *args, **kwargs)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
    except Exception as e:  # noqa: BLE001  (the error poisons the results; whoever reads them hears of it)
        ex.fulfill(out, error=e, what=f"{type(actor).__qualname__}.{method}")
        return
    ex.fulfill(out, value)
