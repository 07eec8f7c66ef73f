"""``shutdown_context()``: stop every mesh this process spawned, at the end of a script.

The runtime itself (its IO thread and template) ends with the process; meshes spawned
after this call still work.
"""

from __future__ import annotations

import threading

from ..runtime import Completion, Runtime
from .future import Future
from .proc_mesh import ProcMesh
from .shape import Shape


def shutdown_context() -> Future[None]:
    """Stop the procs of every mesh this process spawned; the Future resolves once all
    have exited (``.get()`` or ``await`` it), raising the first stop's error if any.

    Example::

        shutdown_context().get()             # every mesh this process spawned stops
    """
    rt = Runtime.existing()
    if rt is None:
        return Future.ready(None)
    stops = [ProcMesh(om.ref, Shape.full(om.ref.dims), om).stop() for om in rt.owned_meshes()]
    done = Completion()
    if not stops:
        done.set_result(None)
        return Future(done)
    left = [len(stops)]
    lock = threading.Lock()

    def one(fut: Future) -> None:
        error = fut.exception(timeout=0)
        if error is not None:
            done.set_exception(error)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done.set_result(None)  # a no-op if an error came first

    for fut in stops:
        fut.then(one)
    return Future(done)
