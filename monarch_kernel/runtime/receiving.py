"""Receiving on this process: who reads which inbox, and a thread that blocks on a call's
answer while reading its own inbox (so a ``.get()`` wakes exactly one thread).

A mixin of ``Runtime``; it uses the runtime's inboxes, signer, IO thread and hooks.
Whoever holds an inbox's lease reads it: the thread blocked on it, or else the IO thread.
``missed`` records an IO-thread wake-up that found the lease taken, so the reader hands the
inbox back when it stops reading.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import zmq

from . import config
from .auth import Dropped
from .completion import Completion
from .envelope import Header, Kind
from .inbox import Inbox

if TYPE_CHECKING:
    from .auth import DropCounts, Signer
    from .calls import PendingCall
    from .curve import CurveKeys
    from .hooks import Hooks
    from .io_thread import IOThread
    from .transport import Transport

LEASE_RECHECK_S = config.seconds("inbox_lease_recheck")


class Receiving:
    """How a process reads its inboxes (mixed into ``Runtime``)."""

    if TYPE_CHECKING:  # what Runtime.__init__ provides
        address: str
        ctx: zmq.Context
        inbox: Inbox
        io: IOThread
        signer: Signer
        transport: Transport
        drops: DropCounts
        hooks: Hooks
        calls: dict[int, PendingCall]
        _local: threading.local
        _thread_inboxes: Iterator[int]
        _free_inboxes: list[Inbox]
        _free_lock: threading.Lock
        bind_ip: str | None
        curve: CurveKeys | None

        def _dispatch(self, h: Header, body: list) -> None: ...

    def watch(self, inbox: Inbox) -> None:
        """Have the IO thread read ``inbox`` too (from now on); any thread may ask."""
        if inbox.watched:
            return
        inbox.watched = True

        def register():
            self.io.loop.add_reader(inbox.sock.getsockopt(zmq.FD), self._drain, inbox)
            self._drain(inbox)

        self.io.call_soon(register)

    def _drain(self, inbox: Inbox) -> None:
        inbox.missed = True
        if not inbox.lease.acquire(blocking=False):
            return
        inbox.missed = False
        try:
            more = self._read(inbox, 10000, inline=False)
        finally:
            inbox.lease.release()
        if more:
            self.io.loop.call_soon(self._drain, inbox)  # let other callbacks run first

    def _drain_inbox(self) -> None:
        self._drain(self.inbox)

    def _read(self, inbox: Inbox, limit: int, inline: bool) -> bool:
        """Read and handle up to ``limit`` messages; True if more may be waiting.

        ``inline`` readers (threads other than the IO thread) handle replies to their own
        calls and CALLs to their own actor themselves and pass anything else on.
        """
        for i in range(limit):
            # A quick poll instead of a failing recv: raising zmq.Again costs more.
            if i and not inbox.ready():
                return False
            frames = inbox.recv()
            if frames is None:
                return False
            try:
                header, body = self.signer.verify(frames)
            except Dropped as d:
                self.transport.received += 1
                self.drops.count(d.reason)
                continue
            k = header.kind
            if k == Kind.HEARTBEAT:
                self.transport.heartbeats += 1  # liveness, not traffic: counted apart
            else:
                self.transport.received += 1
            if not inline or k == Kind.REPLY or k == Kind.CALL:
                self._dispatch_safely(header, body)
            else:
                self.io.call_soon(self._dispatch_safely, header, body)
        return True

    def _dispatch_safely(self, header: Header, body: list) -> None:
        try:
            self._dispatch(header, body)
        except Exception as e:  # a bug in handling one message must not stop the loop
            logging.getLogger(__name__).exception("monarch_kernel: error handling %s: %r", Kind(header.kind).name, e)

    def reply_inbox(self) -> Inbox:
        """The inbox replies to the calling thread's calls come back to."""
        if self.io.is_current():
            return self.inbox
        holder = getattr(self._local, "holder", None)
        if holder is None:
            with self._free_lock:
                inbox = self._free_inboxes.pop() if self._free_inboxes else None
            if inbox is None:
                if self.address.startswith("tcp://"):  # a process on another host: TCP only
                    inbox = Inbox(self.ctx, f"tcp://{self.bind_ip}:*", self.curve)
                else:
                    inbox = Inbox(self.ctx, f"{self.address}.t{next(self._thread_inboxes)}")
                    if self.bind_ip is not None:  # it listens for other hosts too
                        inbox.listen_tcp(self.bind_ip, self.curve)
            holder = self._local.holder = _ThreadInbox(self, inbox)
        return holder.inbox

    def _release_inbox(self, inbox: Inbox) -> None:
        """A thread ended: the IO thread reads its inbox (answers to calls it left behind
        still land) until another thread takes it over."""
        if any(c.inbox is inbox for c in list(self.calls.values())):
            self.watch(inbox)
        with self._free_lock:
            self._free_inboxes.append(inbox)

    def wait(self, completion: Completion, timeout: float | None, inbox: Inbox | None = None) -> bool:
        """Block until ``completion`` is done, reading ``inbox`` meanwhile if nobody is.

        The wait hook (``hooks.wait``; the kernel installs one) gets a turn between slices, outside the
        inbox lease: a rank stopped in pdb is served from the cell that waits on it.
        """
        if completion.done():
            return True
        hook = self.hooks.wait.current()
        deadline = None if timeout is None else time.monotonic() + timeout
        if inbox is None or self.io.is_current():
            if hook is None:
                return completion.wait(timeout)
            while not completion.done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                completion.wait(LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S))
                if hook.pending():
                    hook.run(completion)
            return True
        while not completion.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if hook is not None and hook.pending():
                hook.run(completion)
                continue
            slice_s = LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S)
            if not inbox.lease.acquire(blocking=False):
                completion.wait(slice_s)  # another thread is reading it for us
                continue
            try:
                while not completion.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    ms = int(1000 * (LEASE_RECHECK_S if left is None else min(left, LEASE_RECHECK_S)))
                    if inbox.ready(max(ms, 1)):
                        self._read(inbox, 64, inline=True)
                    elif hook is not None and hook.pending():
                        break
            finally:
                inbox.lease.release()
                if inbox.missed:
                    self.io.call_soon(self._drain, inbox)
        return True


class _ThreadInbox:
    """Thread-local owner of a thread's reply inbox: when the thread ends, the inbox goes
    back to the runtime's pool (so short-lived threads cost no descriptors), read by the IO
    thread meanwhile so replies to calls it left behind still land."""

    def __init__(self, runtime, inbox: Inbox):
        self.runtime = runtime
        self.inbox = inbox

    def __del__(self):
        try:
            self.runtime._release_inbox(self.inbox)
        except Exception:  # interpreter shutdown
            pass
