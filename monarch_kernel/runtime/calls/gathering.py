"""The calls passing through this rank as a node of their multicast tree: what each still
waits for, and the messages that change it.  A child's answer (a REPLY at hop 1), a REDIRECT
(the node's parent died: answer the origin instead) and a PRUNE (a child's subtree died: stop
waiting for it) are handled here, where that state lives; a node's gathered answer goes up
through the outbox it is given (``Outbox.send_reply``), never by another route.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..wire.envelope import Header, Part, split_parts
from .tree import NodeState, NodeTable

if TYPE_CHECKING:
    from ..context import MeshRef
    from ..wire.auth import DropCounts
    from .outbox import Outbox


class Gathering:
    def __init__(self, *, outbox: Outbox, drops: DropCounts, memberships: dict[str, tuple[MeshRef, int]]):
        """``memberships``: mesh id -> (mesh, this process's rank in it)."""
        self.outbox = outbox
        self.drops = drops
        self.memberships = memberships
        self.nodes = NodeTable()

    def my_rank(self, mesh_id: str) -> int:
        """This process's rank in mesh ``mesh_id`` (-1 if it is not in it)."""
        member = self.memberships.get(mesh_id)
        return member[1] if member else -1

    def start(self, h: Header, waiting: set[int]) -> bool:
        """Begin gathering the answers to call ``h`` from ``waiting`` (this rank and its
        children); False if the call must not run here (seen already, or declared lost)."""
        return self.nodes.start((h.origin, h.call_id), h.reply_to, h.hop > 0, waiting, h.resend)

    def answer(self, h: Header, me: int, part: Part, direct=None) -> None:
        """This rank's own answer to call ``h``; ``direct``: see ``Outbox.send_reply``."""
        st = self.nodes.add((h.origin, h.call_id), me, [part])
        if st is not None:
            self.outbox.send_reply(st, h.origin, h.call_id, me, h.mesh, direct)

    def on_reply(self, h: Header, body: list) -> None:
        """A REPLY at hop 1: a child subtree's gathered answer to a call this rank forwarded."""
        self.outbox.learn_direct(h)
        st = self.nodes.add((h.origin, h.call_id), h.ranks[0], split_parts(h, body))
        if st is not None:
            self.outbox.send_reply(st, h.origin, h.call_id, self.my_rank(h.mesh), h.mesh)

    def on_redirect(self, h: Header, _body: list) -> None:
        outcome = self.nodes.redirect((h.origin, h.call_id), h.origin)
        me = self.my_rank(h.mesh)
        if isinstance(outcome, tuple):
            self.outbox.send_reply(NodeState(h.origin, False, set(), outcome[1]), h.origin, h.call_id, me, h.mesh)
        elif outcome == "lost":
            self.outbox.send_or_report(h.origin, Header.not_received(h, me), [], f"a NOT_RECEIVED from rank {me}")

    def on_prune(self, h: Header, _body: list) -> None:
        if h.payload is None:
            self.drops.count("malformed")
            return
        st = self.nodes.prune((h.origin, h.call_id), h.payload.rank)
        if st is not None:
            self.outbox.send_reply(st, h.origin, h.call_id, h.ranks[0] if h.ranks else -1)
