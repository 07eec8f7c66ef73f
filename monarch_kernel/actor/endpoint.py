"""``@endpoint``: how an actor's method is declared callable from other processes (sync or
async, concurrent, with an explicit response port, retried on a replaced rank).  Calling it on
a mesh (``call``, ``call_one``, ``broadcast``, ``choose``, ``stream``) is ``adverbs.py``.

Example::

    class Trainer(Actor):
        @endpoint
        def step(self, batch: int) -> float: ...

    trainers.step.call(3).get()      # ValueMesh, one value per rank
    trainers.slice(gpus=0).step.call_one(3).get()
"""

from __future__ import annotations

import inspect

from ..runtime import CONCURRENT_MARK, ENDPOINT_MARK

RREF_METHOD = "__monarch_rref__"  # the Actor endpoint that runs another for ``rref`` (never listed)


def endpoint(fn=None, *, explicit_response_port: bool = False, propagate=None, concurrent: bool = False,
             instrument: bool = True, retries: int = 0):
    """Mark an actor method as callable from other processes (sync or async).

    An actor takes its messages one at a time, in order, async endpoints included;
    ``concurrent=True`` (or ``@concurrent_endpoint``) lets an async endpoint run as a task
    beside the actor's later messages instead.  ``retries=N`` (Ray's ``max_task_retries``,
    -1: no limit): a call in flight on a rank that dies is re-sent to its replacement (under
    the mesh's restart policy) and its caller sees only the result.

    Example::

        class Trainer(Actor):
            @endpoint
            def step(self, batch: int) -> float:
                return 1.0 / batch

            @endpoint(retries=2)          # safe to run again on a replaced rank
            def load(self, path: str) -> int: ...
    """
    if not isinstance(retries, int) or retries < -1:
        raise ValueError(f"endpoint(retries={retries!r}): how many times a call is re-sent to a replaced rank "
                         "(0: never, -1: no limit)")

    def mark(f):
        if concurrent and not inspect.iscoroutinefunction(f):
            raise ValueError("concurrent_endpoint can only wrap async endpoints")
        f.__monarch_retries__ = retries
        if explicit_response_port:
            f = _with_port(f)
        setattr(f, ENDPOINT_MARK, True)
        setattr(f, CONCURRENT_MARK, concurrent)
        f.__monarch_port__ = explicit_response_port
        f.__monarch_propagate__ = propagate
        return f

    return mark(fn) if fn is not None else mark


def concurrent_endpoint(method=None, *, propagate=None, explicit_response_port: bool = False,
                        instrument: bool = True):
    """``@endpoint(concurrent=True)``, spelled as Monarch spells it: the async endpoint runs
    as a task on the actor's loop, so the actor takes its next message meanwhile.

    Example::

        class Server(Actor):
            @concurrent_endpoint
            async def wait_for(self, key: str) -> str:
                return await self.table.get(key)
    """
    def wrap(f):
        if getattr(f, ENDPOINT_MARK, False):
            raise ValueError("concurrent_endpoint does not wrap @endpoint; pass endpoint options to "
                             "@concurrent_endpoint")
        return endpoint(f, explicit_response_port=explicit_response_port, propagate=propagate, concurrent=True)

    return wrap(method) if method is not None else wrap


def refuse_mixed_endpoints(cls: type) -> None:
    """Strict mode only: Monarch refuses an actor class that mixes sync and async endpoints
    (a sync endpoint that waits can deadlock its asyncio loop); so do we, with its message.
    By default mixing is allowed, since every endpoint here runs on the actor's own worker."""
    from ..runtime import config

    if not config.strict():
        return
    marked = [(n, getattr(cls, n)) for n in sorted(dir(cls))
              if getattr(getattr(cls, n, None), ENDPOINT_MARK, False) and n != RREF_METHOD]
    sync = [n for n, f in marked if not inspect.iscoroutinefunction(f)]
    async_ = [n for n, f in marked if inspect.iscoroutinefunction(f)]
    if sync and async_:
        raise ValueError(
            f"{cls} mixes both async and sync endpoints."
            "Synchronous endpoints cannot be mixed with async endpoints because they can cause the "
            f"asyncio loop to deadlock if they wait.sync: {sync} async: {async_} "
            "(monarch_kernel allows this unless MONARCH_KERNEL_STRICT=1 is set)")


def _with_port(f):
    """The runtime hands an explicit-response endpoint its port as (address, id, rank);
    the endpoint gets a ``Port``."""
    import functools
    import inspect

    def port_of(triple):
        from .port import Port

        return Port(*triple)

    if inspect.iscoroutinefunction(f):
        @functools.wraps(f)
        async def call_async(self, port, *args, **kwargs):
            return await f(self, port_of(port), *args, **kwargs)

        return call_async

    @functools.wraps(f)
    def call(self, port, *args, **kwargs):
        return f(self, port_of(port), *args, **kwargs)

    return call
