"""The runtime's one extension point: typed hooks on a ``Runtime`` instance.

Upper layers (the actor layer, the kernel, the console, the debugger) meet the runtime only
here and through public methods.  Installing a hook returns a ``Handle`` whose ``remove()``
uninstalls it; importing a module never installs anything.  Process-wide patches an upper
layer needs (``sys.breakpointhook`` on a rank, say) go through ``Hooks.patch`` so that they
too are undone by their handle.

Example::

    handle = Runtime.current().hooks.output.install(my_sink)
    ...
    handle.remove()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from .failure import DeathInfo, MeshFailure
from .spawn.host_messages import Message
from .spawn.rank_output import print_sink

log = logging.getLogger(__name__)

class OutputSink(Protocol):
    """Called on the IO thread for every line a rank of a mesh this process spawned writes
    (``stream`` is "stdout" or "stderr"); must not block.  A sink that also has a
    ``write(mesh, rank, stream, text, /)`` method is given the text as it arrives instead, in
    chunks that may end inside a line, and cuts lines itself (the kernel's, so a line not yet
    ended shows at once)."""

    def __call__(self, mesh: str, rank: int, stream: str, line: str, /) -> None: ...


class RecordHook(Protocol):
    """Called on the IO thread with the whole lines each chunk a rank of a mesh this process
    spawned (or this agent forked) writes ends, as bytes, each line ended by a newline,
    whatever the output sink does with them: ``stream`` is "stdout", "stderr", or "control"
    for lines a rank wrote for the controller alone (``CONTROL_MARK``, never shown;
    ``monarch_kernel.metric`` writes them).  The history records here; it must only append
    (one call per chunk, however many lines: it cuts them on its own thread)."""

    def __call__(self, mesh: str, rank: int, stream: str, lines: bytes, /) -> None: ...


class DeathHook(Protocol):
    """Called on the IO thread when a rank of a mesh this process spawned has exited, after
    its pending calls have failed."""

    def __call__(self, mesh_id: str, rank: int, info: DeathInfo, /) -> None: ...


class RestartHook(Protocol):
    """Called on the IO thread when a rank of a mesh this process spawned died and its
    restart policy is "on-failure", after its pending calls have failed: ``replace`` True
    within the policy's budget (no supervision event is raised), False past it (the mesh
    fails as a crash loop).  It must not block: the actor layer's healer
    (``actor/self_healing.py``) queues the replacement on a thread of its own."""

    def __call__(self, mesh_id: str, rank: int, info: DeathInfo, replace: bool, /) -> None: ...


class UnhandledHook(Protocol):
    """Called on the IO thread of the root controller with a failure no supervisor handled.
    It must never exit the process."""

    def __call__(self, failure: MeshFailure, /) -> None: ...


class WaitHook(Protocol):
    """Consulted by a thread blocked in ``Runtime.wait`` between short slices: when
    ``pending()`` is true, ``run(completion)`` gets the thread (the kernel serves ranks
    stopped in pdb from the cell that waits on them)."""

    def pending(self) -> bool: ...

    def run(self, completion: Any) -> None: ...


class EndpointErrorHook(Protocol):
    """Called on a rank, on the thread whose sync endpoint raised, before the caller hears
    of it (post-mortem debugging stops there)."""

    def __call__(self, error: Exception, /) -> None: ...


class SpawnedHook(Protocol):
    """Called in the spawning thread once a proc mesh spawned from this process is up."""

    def __call__(self, proc_mesh: Any, /) -> None: ...


F = TypeVar("F")


class Handle:
    """What installing returns: ``remove()`` undoes it (more than once is harmless)."""

    def __init__(self, undo: Callable[[], None]):
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    @property
    def installed(self) -> bool:
        return self._undo is not None


class HookPoint(Generic[F]):
    """One hook: the functions installed there, newest last.

    A *single* point uses only its newest function (or its default); a *multi* point calls
    every installed function in order.
    """

    def __init__(self, name: str, multi: bool, default: F | None = None):
        self.name = name
        self.multi = multi
        self.default = default
        self._installed: list[F] = []
        self._lock = threading.Lock()

    def install(self, fn: F) -> Handle:
        with self._lock:
            self._installed.append(fn)

        def undo():
            with self._lock:
                for i in range(len(self._installed) - 1, -1, -1):
                    if self._installed[i] is fn:
                        del self._installed[i]
                        break

        return Handle(undo)

    def has(self, fn: F) -> bool:
        return any(f is fn for f in self._installed)

    def current(self) -> F | None:
        """The newest function installed (a single point's effective one), else the default."""
        installed = self._installed
        return installed[-1] if installed else self.default

    def all(self) -> list[F]:
        return list(self._installed)


def _print_unhandled(failure: MeshFailure) -> None:
    log.error("monarch_kernel: unhandled failure: %s", failure)


class HostHook(Protocol):
    """Installed by a host's agent (``monarch_kernel.agent``): called on the IO thread with
    each authenticated ``host_messages`` message from the controller, and the address it came from."""

    def __call__(self, origin: str, msg: Message, /) -> None: ...


class Hooks:
    """Every hook of one runtime.  Who calls each, and when, is in its Protocol above."""

    def __init__(self):
        self.output: HookPoint[OutputSink] = HookPoint("output", multi=False, default=print_sink)
        self.record: HookPoint[RecordHook] = HookPoint("record", multi=True)
        self.death: HookPoint[DeathHook] = HookPoint("death", multi=True)
        self.restart: HookPoint[RestartHook] = HookPoint("restart", multi=False)
        self.unhandled: HookPoint[UnhandledHook] = HookPoint("unhandled", multi=False, default=_print_unhandled)
        self.wait: HookPoint[WaitHook] = HookPoint("wait", multi=False)
        self.endpoint_error: HookPoint[EndpointErrorHook] = HookPoint("endpoint_error", multi=False)
        self.spawned: HookPoint[SpawnedHook] = HookPoint("spawned", multi=True)
        self.host: HookPoint[HostHook] = HookPoint("host", multi=False)
        self._patch_lock = threading.Lock()

    def patch(self, owner: Any, name: str, value: Any) -> Handle:
        """Set ``owner.name`` (or ``owner[name]`` for a dict) to ``value`` until removed;
        removing puts back what was there, if nobody has patched it since."""
        is_dict = isinstance(owner, dict)
        with self._patch_lock:
            missing = object()
            old = owner.get(name, missing) if is_dict else getattr(owner, name, missing)
            if is_dict:
                owner[name] = value
            else:
                setattr(owner, name, value)

        def undo():
            with self._patch_lock:
                now = owner.get(name) if is_dict else getattr(owner, name, None)
                if now is not value:
                    return  # patched again since: leave the newer patch alone
                if old is missing:
                    if is_dict:
                        owner.pop(name, None)
                    else:
                        delattr(owner, name)
                elif is_dict:
                    owner[name] = old
                else:
                    setattr(owner, name, old)

        return Handle(undo)
