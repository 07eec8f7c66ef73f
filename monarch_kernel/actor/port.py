"""``Port`` and ``Channel``: send values to a process without a call.

Example::

    class Doubler(Actor):
        @endpoint(explicit_response_port=True)
        def double(self, port: Port, x: int) -> None:
            port.send(2 * x)            # may also happen later, from another thread

    port, receiver = Channel.open()
    workers.report.broadcast(port)      # each worker calls port.send(...)
    first = receiver.recv().get()
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

from ..runtime import Completion, Part, RemoteFailure, Runtime, Status, describe_unpicklable, dumps
from .adverbs import part_value
from .future import Future

R = TypeVar("R")


class Port(Generic[R]):
    """Where one (response port) or many (channel) values go; small and picklable.

    Example::

        class Producer(Actor):
            @endpoint
            def produce(self, port: Port) -> None:
                port.send(current_rank().rank)
    """

    __slots__ = ("address", "port_id", "rank")

    def __init__(self, address: str, port_id: int, rank: int = 0):
        self.address, self.port_id, self.rank = address, port_id, rank

    def send(self, value: R, *, mesh_id: str | None = None) -> None:
        """``mesh_id``: a mesh of the port's process whose key signs the value (default: this
        process's own); the kernel answering a detached mesh's rank signs with that mesh's."""
        try:
            frames = dumps(value)
        except Exception as e:
            raise TypeError(f"a value sent to a port cannot be pickled: {describe_unpicklable(value, e)}") from e
        Runtime.current().send_port(self.address, self.port_id, Part(self.rank, Status.OK, frames), mesh_id)

    def exception(self, error: BaseException) -> None:
        """Answer with an error; the receiver raises it as an ``ActorError``."""
        failure = RemoteFailure.capture(self.rank, "port", "send", error, frames_to_skip=0)
        Runtime.current().send_port(self.address, self.port_id, Part(self.rank, Status.RAISED, dumps(failure)))

    def __reduce__(self):
        return (Port, (self.address, self.port_id, self.rank))

    def __repr__(self) -> str:
        return f"Port({self.port_id} at {self.address})"


class PortReceiver(Generic[R]):
    """The receiving end of a channel: ``recv()`` is a Future of the next value.

    Example::

        port, receiver = Channel.open()
        producers.produce.broadcast(port)
        print(receiver.recv().get())
    """

    def __init__(self):
        self._parts: collections.deque = collections.deque()
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def _deliver(self, part: Part) -> None:
        with self._lock:
            if not self._waiting:
                self._parts.append(part)
                return
            c = self._waiting.popleft()
        c.set_result(part)

    def recv(self) -> Future[R]:
        c = Completion()
        with self._lock:
            if self._parts:
                part = self._parts.popleft()
            else:
                self._waiting.append(c)
                part = None
        if part is not None:
            c.set_result(part)
        return Future(c, lambda p: part_value(p, "channel", "recv"))


class Channel(Generic[R]):
    """A channel: a port that many values can be sent to, and the receiver that reads them
    (Monarch's ``Channel.open()``).

    Example::

        port, receiver = Channel.open()
        workers.produce.call(port)                  # each rank sends to port
        first = receiver.recv().get()
    """

    @staticmethod
    def open(once: bool = False) -> tuple[Port[R], PortReceiver[R]]:
        """A port and its receiver; values sent to the port from any process queue up."""
        rt = Runtime.current()
        receiver: PortReceiver[R] = PortReceiver()
        port_id = rt.open_port(receiver._deliver, once=once)
        return Port(rt.port_address, port_id), receiver
