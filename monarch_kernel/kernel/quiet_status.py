"""Which requests the kernel answers without a busy/idle status: the comm messages of the
Mesh panel.  JupyterLab shows as the notebook's state the last status message on IOPub,
whatever request it belongs to (@jupyterlab/services ``KernelConnection._handleMessage``);
the panel sends its requests on a subshell while a cell runs, so their "idle" would say
the kernel is idle in the middle of the cell.  The panel's requests are not the
notebook's work: they publish no status at all, and every other request keeps its pair.
Pure bookkeeping over message dicts; it sends nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

COMM_KINDS = ("comm_open", "comm_msg", "comm_close")


class QuietRequests:
    """Decides, per status message, whether it is published: not for the comm messages of
    a quiet target.  The decision made at "busy" holds for the request's "idle" (a
    ``comm_close`` has removed its comm by then)."""

    def __init__(self, targets: Iterable[str], target_of: Callable[[str], str | None]):
        self.targets = frozenset(targets)
        self._target_of = target_of  # comm id -> its target's name (None: no such comm)
        self._lock = threading.Lock()  # subshells publish from their own threads
        self._in_flight: set[str] = set()  # msg_ids of quiet requests whose "idle" is still due

    def publishes(self, status: str, parent: dict | None) -> bool:
        """Whether the status ``status`` of request ``parent`` goes out."""
        header = (parent or {}).get("header") or {}
        if header.get("msg_type") not in COMM_KINDS or status not in ("busy", "idle"):
            return True
        msg_id = header.get("msg_id", "")
        with self._lock:
            if status == "idle":
                if msg_id in self._in_flight:
                    self._in_flight.discard(msg_id)
                    return False
                return True
            if not self._quiet(header["msg_type"], (parent or {}).get("content") or {}):
                return True
            self._in_flight.add(msg_id)
            return False

    def _quiet(self, kind: str, content: dict) -> bool:
        if kind == "comm_open":
            return content.get("target_name") in self.targets
        return self._target_of(str(content.get("comm_id", ""))) in self.targets
