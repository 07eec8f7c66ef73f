"""The multicast tree: how a call to N ranks is cut into subtrees, and the per-node state
that merges replies on the way back.

A subtree is a list of ranks whose first element is its root; the root runs the call and
forwards the rest, cut again into at most ``fanout`` subtrees.  The caller can recompute
any node's children from the rank list alone, which is how it repairs a call when a
forwarding rank dies.  Nothing here unpickles.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TypeVar

from ..wire.envelope import Part

T = TypeVar("T")


def split(ranks: list[T], fanout: int) -> list[list[T]]:
    """Cut ``ranks`` into at most ``fanout`` contiguous, nearly equal subtrees."""
    n = len(ranks)
    k = max(1, min(fanout, n))
    out: list[list[T]] = []
    start = 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        if size:
            out.append(ranks[start : start + size])
        start += size
    return out


def split_groups(groups: list[list[int]], fanout: int) -> list[list[int]]:
    """Like ``split``, but never cutting a group: at most ``fanout`` subtrees, each some whole
    ``groups`` (the ranks one connection carries) in a row."""
    return [[r for g in part for r in g] for part in split(groups, fanout)]


def children(subtree: list[int], fanout: int) -> list[list[int]]:
    return split(subtree[1:], fanout)


def locate(ranks: list[int], fanout: int, rank: int,
           top: list[list[int]] | None = None) -> tuple[int | None, list[int]] | None:
    """Find ``rank`` in the tree the caller built over ``ranks`` (its first level ``top``, when
    the caller did not cut it with ``split``: ``split_groups``).

    Returns ``(parent, subtree)``: the parent's rank (``None`` when the caller itself is the
    parent) and the subtree rooted at ``rank``; ``None`` if the rank is not in the tree.
    """
    parent: int | None = None
    level = top if top is not None else split(ranks, fanout)
    while True:
        for sub in level:
            if sub[0] == rank:
                return parent, sub
            if rank in sub:
                parent, level = sub[0], children(sub, fanout)
                break
        else:
            return None


class _LRU(OrderedDict):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def put(self, key, value=True):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


@dataclass
class NodeState:
    reply_to: str
    to_node: bool  # replying to a forwarding rank (True) or to the origin itself
    waiting: set[int]  # own rank and the roots of child subtrees still to answer
    parts: list[Part] = field(default_factory=list)


class NodeTable:
    """Per-rank record of calls in progress, seen, and answered through a parent.

    Thread-safe: actor worker threads add their own part, the IO thread adds children's.
    Whoever completes a node gets its reply back from ``add`` and sends it.
    """

    def __init__(self, cache: int = 128, seen: int = 8192):
        self._lock = threading.Lock()
        self.active: dict[tuple, NodeState] = {}
        self.cache = _LRU(cache)  # key -> parts already sent to a parent rank
        self.seen = _LRU(seen)
        self.tombstones = _LRU(seen)

    def start(self, key, reply_to: str, to_node: bool, waiting: set[int], resend: bool) -> bool:
        """Record a CALL; False if it must not run (seen already, or declared lost)."""
        with self._lock:
            if key in self.seen or (key in self.tombstones and not resend):
                return False
            self.seen.put(key)
            self.active[key] = NodeState(reply_to, to_node, waiting)
            return True

    def add(self, key, from_rank: int, parts: list[Part]):
        """Add parts answering for ``from_rank``; returns the finished ``NodeState`` when complete."""
        with self._lock:
            st = self.active.get(key)
            if st is None or from_rank not in st.waiting:
                return None
            st.waiting.discard(from_rank)
            st.parts.extend(parts)
            return self._finish(key, st)

    def prune(self, key, child_root: int):
        """Stop waiting for a child subtree whose root died (its caller repairs it)."""
        with self._lock:
            st = self.active.get(key)
            if st is None or child_root not in st.waiting:
                return None
            st.waiting.discard(child_root)
            return self._finish(key, st)

    def _finish(self, key, st: NodeState):
        if st.waiting:
            return None
        del self.active[key]
        if st.to_node:
            self.cache.put(key, st.parts)
        return st

    def redirect(self, key, origin: str):
        """The parent died: returns ``"active"``, ``("resend", parts)``, ``"done"`` or ``"lost"``."""
        with self._lock:
            st = self.active.get(key)
            if st is not None:
                st.reply_to, st.to_node = origin, False
                return "active"
            if key in self.cache:
                return "resend", self.cache.pop(key)
            if key in self.seen:
                return "done"
            self.tombstones.put(key)
            return "lost"
