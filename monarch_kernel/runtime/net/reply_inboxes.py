"""The threads' own reply inboxes: each thread that makes calls gets one, where the answers
to its calls come back and where it waits on them; a thread that ends gives it back for
reuse (so short-lived threads cost no descriptors), and the IO thread reads it meanwhile if a
call still waits there.  Owned by the caller, whose calls wait on them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .inbox import Inbox
    from .io_thread import IOThread
    from .network import Network


class ReplyInboxes:
    def __init__(self, *, io: IOThread, network: Network, main: Inbox, watch: Callable[[Inbox], None],
                 in_use: Callable[[Inbox], bool]):
        """``main``: the process's main inbox (the IO thread's own calls' answers come there);
        ``watch``: has the IO thread read an inbox (``Receiver.watch``); ``in_use(inbox)``:
        whether a call still waits for answers there."""
        self.io = io
        self.network = network
        self.main = main
        self._watch = watch
        self._in_use = in_use
        self._local = threading.local()
        self._count = 0
        self._free: list[Inbox] = []  # reply inboxes of threads that ended, for reuse
        self._lock = threading.Lock()

    def mine(self) -> Inbox:
        """The inbox replies to the calling thread's calls come back to (the main inbox on
        the IO thread itself)."""
        if self.io.is_current():
            return self.main
        holder = getattr(self._local, "holder", None)
        if holder is None:
            with self._lock:
                inbox = self._free.pop() if self._free else None
                if inbox is None:
                    self._count += 1
                    n = self._count
            if inbox is None:
                # its address depends on how the process listens, which the network knows
                inbox = self.network.thread_inbox(self.main.address, n)
            holder = self._local.holder = _ThreadInbox(self, inbox)
        return holder.inbox

    def release(self, inbox: Inbox) -> None:
        """A thread ended: the IO thread reads its inbox (answers to calls it left behind
        still land) until another thread takes it over."""
        if self._in_use(inbox):
            self._watch(inbox)
        with self._lock:
            self._free.append(inbox)


class _ThreadInbox:
    """Thread-local owner of a thread's reply inbox: when the thread ends, the inbox goes
    back to the pool, read by the IO thread meanwhile so replies to calls it left behind
    still land."""

    def __init__(self, inboxes: ReplyInboxes, inbox: Inbox):
        self.inboxes = inboxes
        self.inbox = inbox

    def __del__(self):
        try:
            self.inboxes.release(self.inbox)
        except Exception:  # interpreter shutdown
            pass
