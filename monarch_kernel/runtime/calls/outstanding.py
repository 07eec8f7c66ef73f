"""Calls this process has made and is waiting on, and how they are repaired when a rank of
the tree dies (the caller knows the whole tree, so it alone decides what is lost).

Parts are kept encoded; the actor layer unpickles them in the caller's thread.  A call is
given what it uses, not the ``Caller`` that made it: the outbox its repairs (wake-ups,
REDIRECT, PRUNE, re-sent subtrees) go out through, and ``finished``, which the caller gives
so that a done call leaves its table.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..completion import Completion
from ..context import MeshRef
from ..errors import SendFailed
from ..failure import DeathInfo
from ..wire.envelope import Header, Kind, Part, Status
from .tree import children, locate, split

if TYPE_CHECKING:
    from ..net.inbox import Inbox
    from .outbox import Outbox


def synthetic_part(rank: int, status: int, obj) -> Part:
    return Part(rank, status, [pickle.dumps(obj)])


class PendingCall:
    __slots__ = ("outbox", "finished", "header", "mesh", "ranks", "top", "body", "on_part", "remaining", "parts",
                 "resent", "completion", "inbox", "segments", "_lock")

    def __init__(self, *, outbox: Outbox, finished: Callable[[PendingCall], None], header: Header, mesh: MeshRef,
                 ranks: list[int], body: list, on_part: Callable[[Part], None] | None, inbox: Inbox,
                 segments: list | None = None):
        """``finished(call)``: called once, when every rank has answered (before the call's
        completion is set); ``inbox``: where its replies arrive (the main inbox when
        callbacks consume them); ``segments``: shared-memory files holding its arguments,
        released when it is done."""
        self.outbox = outbox
        self.finished = finished
        self.header = header
        self.mesh = mesh
        self.ranks = ranks  # ranks the tree was built over (alive when sent)
        self.top: list[list[int]] | None = None  # the tree's first level, if not split(ranks, fanout)
        self.body: list | None = body  # kept to re-send subtrees whose forwarder died before forwarding
        self.on_part = on_part
        self.remaining = set(ranks)
        self.parts: dict[int, Part] = {}
        self.resent: set[int] = set()
        self.completion = Completion()
        self.inbox: Inbox | None = inbox
        self.segments = segments
        self._lock = threading.Lock()

    def add(self, parts: list[Part]) -> None:
        new = []
        with self._lock:
            for p in parts:
                if p.rank in self.remaining:  # first answer wins; repairs may repeat some
                    self.remaining.discard(p.rank)
                    self.parts[p.rank] = p
                    new.append(p)
            finished = not self.remaining
        if self.on_part is not None:
            for p in new:
                self.on_part(p)
        if finished and new:
            self.body = None
            self.finished(self)
            self.completion.set_result(self.parts)

    def rank_died(self, rank: int, info: DeathInfo) -> None:
        """Called on the IO thread: fail ``rank`` and reroute the replies it was carrying."""
        with self._lock:
            pending = rank in self.remaining
        if not pending:
            return
        found = locate(self.ranks, self.header.fanout, rank, self.top)
        self.add([synthetic_part(rank, Status.DIED, info)])
        outbox, h = self.outbox, self.header
        if self.inbox is not None and self.inbox is not outbox.inbox:
            # The calling thread may be blocked reading its own inbox: nudge it.
            outbox.send_or_report(self.inbox.address, Header.control(Kind.WAKE), [], "a wake-up")
        if found is None:
            return
        parent, subtree = found
        for child in children(subtree, h.fanout):
            outbox.send_control(self.mesh, child[0], Kind.REDIRECT, h.call_id, origin=h.origin)
        if parent is not None and h.mode == 0:
            outbox.prune(self.mesh, parent, h.call_id, rank, h.origin)

    def not_received(self, rank: int) -> None:
        """``rank`` never got the call (its forwarder died first): send its subtree again."""
        if self.body is None:
            return
        found = locate(self.ranks, self.header.fanout, rank, self.top)
        if found is None:
            return
        with self._lock:
            todo = [r for r in found[1] if r in self.remaining and r not in self.resent]
            self.resent.update(todo)
        outbox = self.outbox
        for sub in split(todo, self.header.fanout):
            h = self.header
            again = Header.resent(h, sub)
            try:
                outbox.send(outbox.target(self.mesh, sub[0], h.kind, h.actor), again, self.body)
            except SendFailed as e:
                self.add([synthetic_part(r, Status.UNSENT, f"{e}") for r in sub])
