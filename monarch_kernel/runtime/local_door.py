"""The door to what stays inside this process: the ports that answers are delivered to, waiting
on an answer while this thread's inbox is read, and the shared-memory segments a call's large
arguments go through.  Mixed into ``Runtime`` as front_door.py's classes are; each method only
delegates, so the receiver, the port table and the segments can change behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .completion import Completion
    from .net.inbox import Inbox
    from .net.ports import PortTable
    from .net.receiver import Receiver
    from .wire.envelope import Part
    from .wire.segments import Segments


class LocalDoor:
    """Ports, waiting, and shared memory: the receiver, the port table and the segments."""

    receiver: Receiver
    ports: PortTable
    segments: Segments | None

    def open_port(self, handler: Callable[[Part], None], *, once: bool) -> int:
        """A port id whose parts go to ``handler`` (on the IO thread); ``once``: it closes
        after its first part."""
        return self.ports.open(handler, once)

    def close_port(self, port_id: int) -> bool:
        """Close a port; False if it was closed already.  A late part for it is dropped."""
        return self.ports.close(port_id)

    def wait_for(self, completion: Completion, timeout: float | None, inbox: Inbox | None = None) -> bool:
        """Block until ``completion`` is done (False after ``timeout`` s), reading ``inbox``
        meanwhile if nobody is (``Receiver.wait``)."""
        return self.receiver.wait(completion, timeout, inbox)

    def watch_inbox(self, inbox: Inbox) -> None:
        """Nobody will block on ``inbox``: have the IO thread read it from now on."""
        self.receiver.watch(inbox)

    def shares_memory(self) -> bool:
        """Whether a call's large arguments can go through shared memory on this host."""
        return self.segments is not None

    @contextmanager
    def tracking_segments(self) -> Iterator[list[str]]:
        """Collect the segments written while one call's arguments are pickled; only where
        ``shares_memory()``."""
        assert self.segments is not None, "no shared memory here: ask shares_memory() first"
        with self.segments.track() as created:
            yield created

    def unlink_segments(self, created: list[str]) -> None:
        """Remove segments written for a call that was never sent."""
        if self.segments is not None:
            self.segments.unlink(created)
