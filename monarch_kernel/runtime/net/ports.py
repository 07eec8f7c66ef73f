"""Ports: addresses any process can send a value to, handled by a callback in the process
that opened them.  Endpoints with an explicit response port answer through one; a
``Channel`` is a port whose values queue for a receiver."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from ..wire.envelope import Part


class PortTable:
    def __init__(self):
        self._ids = itertools.count(1)
        self._handlers: dict[int, tuple[Callable[[Part], None], bool]] = {}
        self._lock = threading.Lock()

    def open(self, handler: Callable[[Part], None], once: bool) -> int:
        port_id = next(self._ids)
        with self._lock:
            self._handlers[port_id] = (handler, once)
        return port_id

    def close(self, port_id: int) -> bool:
        with self._lock:
            return self._handlers.pop(port_id, None) is not None

    def deliver(self, port_id: int, part: Part) -> bool:
        """Hand ``part`` to the port's handler; False if the port is closed (or used up)."""
        with self._lock:
            entry = self._handlers.get(port_id)
            if entry is None:
                return False
            if entry[1]:
                del self._handlers[port_id]
        entry[0](part)
        return True
