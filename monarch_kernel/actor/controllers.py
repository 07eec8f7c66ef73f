"""``get_or_spawn_controller``: one named singleton actor per job, hosted by the job's root
controller and reachable from every process of the job.

The root keeps the registry; other processes (ranks, ranks of ranks' meshes) ask it through
a job-wide port their launch config carries.  Nothing is opened until the root spawns.

Example::

    store = get_or_spawn_controller("store", Store).get()   # same actor from any rank
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import TYPE_CHECKING, Any, TypeVar

from ..runtime import Completion, Part, Runtime, loads
from .future import Future

if TYPE_CHECKING:
    from .actor_mesh import ActorMesh

log = logging.getLogger(__name__)
T = TypeVar("T")
PORT_NAME = "controllers"


class _Registry:
    """The root's singletons: name -> Completion of its ActorMesh (or of the spawn's error)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Completion] = {}

    def get_or_spawn(self, name: str, cls: type, args: tuple, kwargs: dict) -> Completion:
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                return entry
            entry = self._entries[name] = Completion()
        from .host_mesh import this_proc  # host_mesh imports this module (publish_registry)

        try:  # outside the lock: an __init__ may ask for another controller.  A fresh
            # context: the singleton belongs to the job, not to whichever actor asked first.
            entry.set_result(contextvars.Context().run(this_proc().spawn, name, cls, *args, **kwargs))
        except BaseException as e:
            entry.set_exception(e)  # as in Monarch, a failed controller stays failed
        return entry

    def on_request(self, part: Part) -> None:
        """On the root's IO thread: a request from another process of the job.  The reply
        port travels outside the request, so an unloadable request is still answered."""

        try:
            reply, request = part.load()
        except Exception as e:  # noqa: BLE001  (nobody to answer: say so where it happened)
            log.error("monarch_kernel: a get_or_spawn_controller request was dropped: %r", e)
            return
        try:
            name, cls, args, kwargs = loads(request)
        except Exception as e:
            reply.exception(e)
            return
        entry = self.get_or_spawn(name, cls, args, kwargs)

        def answer(done: Completion) -> None:
            error = done.error()
            if error is None:
                reply.send(done.result())
            else:
                reply.exception(error)

        entry.add_done_callback(answer)


_registry = _Registry()
_publish_lock = threading.Lock()


def publish_registry(rt: Runtime) -> None:
    """On the job's root, before its first mesh is launched: open the port its ranks ask."""
    if rt.owner is None and PORT_NAME not in rt.job_ports:
        with _publish_lock:
            rt.publish_port(PORT_NAME, _registry.on_request)


def get_or_spawn_controller(name: str, cls: type[T], *args: Any, **kwargs: Any) -> Future[ActorMesh[T]]:
    """The job's singleton actor called ``name``, spawned (as ``cls(*args, **kwargs)``, on
    the root controller's own process) by the first caller from any process of the job;
    later callers get the same actor.  Returns a Future of its ``ActorMesh``.

    Example::

        registry = get_or_spawn_controller("registry", Registry).get()
        registry.register.call_one("worker-1").get()
    """
    if not isinstance(name, str):
        raise TypeError(f"a controller's name is a str, not {type(name).__name__}")
    if not isinstance(cls, type):
        raise TypeError(f"get_or_spawn_controller takes an Actor class, not {type(cls).__name__}")
    rt = Runtime.current()
    if rt.owner is None:  # the root itself
        return Future(_registry.get_or_spawn(name, cls, args, kwargs))
    where = rt.job_ports.get(PORT_NAME)
    if where is None:
        raise RuntimeError("this process cannot reach its job's root controller (its launch config named no "
                           "controller registry); call get_or_spawn_controller from the controller instead")
    import cloudpickle

    from .port import Channel, Port, PortReceiver

    try:
        request = cloudpickle.dumps((name, cls, args, kwargs))
    except Exception as e:
        raise TypeError(f"get_or_spawn_controller({name!r}, {cls.__qualname__}, ...) cannot be sent to the "
                        f"root controller: {e}") from e
    pair: tuple[Port[ActorMesh[T]], PortReceiver[ActorMesh[T]]] = Channel.open(once=True)
    reply, receiver = pair
    ask: Port[tuple] = Port(*where)
    ask.send((reply, request))
    return receiver.recv()
