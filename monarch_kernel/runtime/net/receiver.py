"""Receiving on this process: who reads which inbox, and a thread that blocks on a call's
answer while reading its own inbox (so a ``.get()`` wakes exactly one thread).  The threads'
reply inboxes themselves are the caller's, whose calls wait on them (``reply_inboxes.py``).

Whoever holds an inbox's lease reads it: the thread blocked on it, or else the IO thread.
``missed`` records an IO-thread wake-up that found the lease taken, so the reader hands the
inbox back when it stops reading.  Every authentic message goes to the ``dispatch`` function
it was made with (the runtime's table); nothing here knows what a kind means, beyond which
kinds a thread other than the IO thread may handle itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .. import config
from ..completion import Completion
from ..hooks import Hooks
from ..wire.auth import DropCounts, Dropped, Signer
from ..wire.envelope import Header
from ..wire.kinds import Kind
from .inbox import Inbox
from .io_thread import IOThread

log = logging.getLogger("monarch_kernel.runtime")

LEASE_RECHECK_S = config.seconds("inbox_lease_recheck")
_INLINE = frozenset((Kind.REPLY, Kind.CALL, Kind.SPAWN, Kind.WAKE))  # kinds a reading thread handles itself


class Receiver:
    """Reads this process's inboxes and hands each authentic message to its kind's handler
    in ``handlers`` (an unknown kind is counted as malformed).

    ``handlers`` is the runtime's dispatch table, read at each message: the receiver is built
    before the parts that handle messages (they read and wait through it), and the runtime
    fills the table once they exist, before any inbox is read.
    """

    def __init__(self, *, io: IOThread, signer: Signer, drops: DropCounts, hooks: Hooks,
                 handlers: dict[int, Callable[[Header, list], None]]):
        self.io = io
        self.signer = signer
        self.drops = drops
        self.hooks = hooks
        self.handlers = handlers
        self.received = 0  # messages read (forged ones included)

    # ------------------------------------------------------------ the IO thread's reading

    def watch(self, inbox: Inbox) -> None:
        """Have the IO thread read ``inbox`` too (from now on); any thread may ask."""
        if inbox.watched:
            return
        inbox.watched = True

        def register():
            for fd in inbox.fds():
                self.io.loop.add_reader(fd, self.drain, inbox)
            self.drain(inbox)

        self.io.call_soon(register)

    def unwatch(self, inbox: Inbox) -> None:
        """The IO thread stops reading ``inbox`` (``watch`` undone); any thread may ask."""
        if not inbox.watched:
            return
        inbox.watched = False
        for fd in inbox.fds():
            self.io.call_soon(self.io.loop.remove_reader, fd)

    def drain(self, inbox: Inbox) -> None:
        """On the IO thread: read what waits in ``inbox``, unless another thread holds it."""
        inbox.missed = True
        if not inbox.lease.acquire(blocking=False):
            return
        inbox.missed = False
        try:
            more = self.read(inbox, 10000, inline=False)
        finally:
            inbox.lease.release()
        if more:
            self.io.loop.call_soon(self.drain, inbox)  # let other callbacks run first

    def read(self, inbox: Inbox, limit: int, inline: bool) -> bool:
        """Read and handle up to ``limit`` waiting messages; True if more may be waiting.

        ``inline`` readers (threads other than the IO thread) handle replies, calls and
        wake-ups themselves and pass anything else to the IO thread.
        """
        for i in range(limit):
            # A quick poll instead of a failing recv: raising zmq.Again costs more.
            if i and not inbox.ready():
                return False
            frames = inbox.recv()
            if frames is None:
                return False
            self.handle(frames, inline)
        return True

    def handle(self, frames: list, inline: bool) -> None:
        """Check one message and dispatch it (dropped and counted when not authentic)."""
        self.received += 1
        try:
            header, body = self.signer.open(frames)
        except Dropped as d:
            self.drops.count(d.reason)
            return
        if inline and header.kind not in _INLINE:
            self.io.call_soon(self.dispatch_safely, header, body)
        else:
            self.dispatch_safely(header, body)

    def dispatch_safely(self, header: Header, body: list) -> None:
        """Hand one authentic message to its handler; what a handler raises is logged."""
        handler = self.handlers.get(header.kind)
        if handler is None:
            self.drops.count("malformed")
            return
        try:
            handler(header, body)
        except Exception:  # a bug in handling one message must not stop the loop
            log.exception("monarch_kernel: error handling %s", Kind(header.kind).name)

    # ------------------------------------------------------------ blocking waits

    def wait(self, completion: Completion, timeout: float | None, inbox: Inbox | None = None) -> bool:
        """Block until ``completion`` is done, reading ``inbox`` meanwhile if nobody is.

        The wait hook (``hooks.wait``; the kernel installs one) gets a turn between slices,
        outside the inbox lease: a rank stopped in pdb is served from the cell that waits on it.
        """
        if completion.done():
            return True
        hook = self.hooks.wait.current()
        deadline = None if timeout is None else time.monotonic() + timeout
        if inbox is None or self.io.is_current():
            return self._wait_plain(completion, deadline, hook)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if hook is not None and hook.pending():
                hook.run(completion)
            elif not inbox.lease.acquire(blocking=False):
                # another thread is reading it for us
                completion.wait(LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S))
            else:
                try:
                    self._read_until(inbox, completion, deadline, hook)
                finally:
                    inbox.lease.release()
                    if inbox.missed:
                        self.io.call_soon(self.drain, inbox)
            if completion.done():
                return True

    def _read_until(self, inbox: Inbox, completion: Completion, deadline: float | None, hook) -> None:
        """Holding the lease, with ``completion`` not done: block in ``recv`` (no poll first:
        the message is there the moment the thread wakes) until done, the deadline, or the
        hook wants the thread."""
        ms = int(1000 * LEASE_RECHECK_S)
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                ms = int(1000 * min(left, LEASE_RECHECK_S))
            frames = inbox.recv_within(max(ms, 1))
            if frames is not None:
                self.handle(frames, True)
                if completion.done():
                    return
            elif hook is not None and hook.pending():
                return

    @staticmethod
    def _wait_plain(completion: Completion, deadline: float | None, hook) -> bool:
        if hook is None:
            return completion.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        while not completion.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            completion.wait(LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S))
            if hook.pending():
                hook.run(completion)
        return True
