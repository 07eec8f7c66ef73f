"""Every message this process sends goes out here: where a message to a rank or an actor
goes (targets, the direct TCP routes actors on other hosts named, the first level of a
tree), answers and their parts, small control messages, tree sends, port values, and
"send or report" for messages nobody waits on (a failure is logged once per peer).

It decides nothing about calls (the caller's), trees' state (the gathering's) or deaths
(the supervision policy's): it addresses and sends.  It is given the IO thread (a port
value for this very process is delivered there), the transport, the network (which of our
addresses a peer can answer), the main inbox, the ports, the process's memberships (mesh
id -> (mesh, my rank), read to pass tree messages on) and the tree's fanout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .. import config
from ..context import MeshRef, process_mesh
from ..errors import SendFailed
from ..net.inbox import Inbox, actor_address
from ..wire.envelope import Header, Kind, Part, Status, join_parts
from ..wire.payloads import InterruptAck, PruneInfo
from ..wire.serialize import dumps
from .tree import split, split_groups

if TYPE_CHECKING:
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..net.ports import PortTable
    from ..net.transport import Transport

log = logging.getLogger("monarch_kernel.runtime")
RESEND_S = config.seconds("answer_resend")  # an answer not sent is tried again this long
RESEND_FIRST_S = config.seconds("answer_resend_first")  # the first wait; doubled each time, up to a second


class Outbox:
    def __init__(self, *, io: IOThread, transport: Transport, network: Network, inbox: Inbox, ports: PortTable,
                 memberships: dict[str, tuple[MeshRef, int]], fanout: int):
        self.io = io
        self.transport = transport
        self.network = network
        self.inbox = inbox  # the process's main inbox (read by the IO thread)
        self.ports = ports
        self.memberships = memberships
        self.fanout = fanout
        # Send one message, raising ``SendFailed``: the transport's own method, with no layer
        # of ours around it (the hot path of every call).
        self.send = transport.send
        self.direct: dict[tuple[str, int, str], str] = {}  # (mesh, rank, actor) -> that actor's own TCP inbox
        # What a late answer of a rank's former process must not teach again (``learn_direct``):
        # the actor inboxes forgotten at a death or a move, and where each moved rank lives now.
        self._stale: set[str] = set()
        self._homes: dict[tuple[str, int], str] = {}  # (mesh, rank) -> the host part of its address now
        self._unsent_reported: set[str] = set()

    # ------------------------------------------------------------ addressing

    def target(self, mesh: MeshRef, rank: int, kind: int, actor: str) -> str:
        """CALLs go to the actor's own inbox on the rank; everything else to the rank's.  On a
        TCP rank an actor's inbox has a port of its own, learnt from its first answer (until
        then its calls go through the rank's main inbox)."""
        base = mesh.addresses[rank]
        if kind != Kind.CALL:
            return base
        if base[:4] == "tcp:":
            return self.direct.get((mesh.id, rank, actor), base)
        return actor_address(base, actor)

    def learn_direct(self, h: Header) -> None:
        """A REPLY may name the answering actor's own TCP inbox: its calls go there from now on.
        Not when it came late from the rank's former process (sent before its death, or from
        the host it moved from, whose link came back): that inbox is gone or going, and a call
        sent there would wait for ever, unanswered and never failed."""
        if h.payload is None or not h.ranks:
            return
        address = h.payload.address
        if address in self.transport.moved:  # a live actor answers from a port a moved rank once had
            self.transport.unforward([address])
        if address in self._stale:
            return
        home = self._homes.get((h.mesh, h.ranks[0])) if self._homes else None
        if home is not None and _host_part(address) != home:
            return
        self.direct[(h.mesh, h.ranks[0], h.payload.actor)] = address

    def forget_rank(self, ref: MeshRef, rank: int) -> None:
        """``rank`` of ``ref`` died: every thread drops its sockets to it and to its actors."""
        if 0 <= rank < len(ref.addresses):
            transport = self.transport
            transport.forget(ref.addresses[rank])
            for key in [k for k in self.direct if k[0] == ref.id and k[1] == rank]:
                self._stale.add(gone := self.direct.pop(key))
                transport.forget(gone)

    def rank_moved(self, mesh_id: str, rank: int, old: str, new: str) -> None:
        """``rank`` of ``mesh_id`` was restarted on another host, at ``new``: what any thread
        sends to ``old`` (every reference made before the move names it) goes there, and its
        actors' own inboxes are learnt again from their answers."""
        transport = self.transport
        if old in self.direct.values():  # a live actor answers from that port now (the host reused it)
            transport.unforward([old])
        else:
            transport.forward(old, new, mesh_id)
        self._homes[(mesh_id, rank)] = _host_part(new)
        for key in [k for k in self.direct if k[0] == mesh_id and k[1] == rank]:
            self._stale.add(gone := self.direct.pop(key))
            transport.forget(gone)

    def forwards(self) -> dict[str, str]:
        """Every move this process knows of, old address -> new: a rank it forks inherits them."""
        return self.transport.forwards()

    def claim(self, addresses) -> None:
        """New ranks will listen at ``addresses`` (ports their hosts just reserved): a forward
        left there by a rank that moved away from the same port earlier no longer applies."""
        if self.transport.moved:
            self.transport.unforward(addresses)

    def forget_mesh(self, mesh_id: str) -> None:
        """Mesh ``mesh_id`` ended: its moved ranks' forwards and homes go (their ports will
        be reused by other processes)."""
        self.transport.unforward(owner=mesh_id)
        for key in [k for k in self._homes if k[0] == mesh_id]:
            del self._homes[key]

    def origin(self, inbox: Inbox, mesh: MeshRef) -> str:
        """The address of ``inbox`` that ``mesh``'s ranks can answer."""
        return self.network.answerable(inbox, mesh.addresses[0]) if mesh.addresses else inbox.address

    def subtrees(self, mesh: MeshRef, ranks: list[int], fanout: int) -> list[list[int]]:
        """The first level of a call's tree over ``ranks``: ``split``, except that the ranks
        one connection carries (an out-of-cluster host's ssh connection) stay in one subtree.
        Such a host is sent one message per call and answers one, gathered there: each
        message of its own through that connection costs a round trip of its own, and
        answers that leave the host together wait on each other (ssh's Nagle)."""
        transport = self.transport
        if not transport.carried:
            return split(ranks, fanout)
        groups: dict = {}
        addresses = mesh.addresses
        for r in ranks:
            key = transport.carrier(addresses[r])
            groups.setdefault(r if key is None else key, []).append(r)
        if len(groups) == len(ranks):
            return split(ranks, fanout)
        return split_groups(list(groups.values()), fanout)

    # ------------------------------------------------------------ messages nobody waits on

    def send_control(self, mesh: MeshRef, rank: int, kind: int, call_id: int = 0, payload=None,
                     origin: str | None = None) -> None:
        """A small message to a rank; ``origin`` names the inbox a call was made from, which
        is how ranks file the calls they serve.  A tree repair (REDIRECT, PRUNE) that cannot
        be sent is logged at DEBUG only: its rank is then gone too (its host died with the
        one repaired around), and its own death fails its part of the call."""
        origin = origin or self.network.answerable(self.inbox, mesh.addresses[rank])
        h = Header.control(kind, origin, mesh.id, [rank], call_id=call_id, payload=payload)
        what = f"{Kind(kind).name} for rank {rank} of mesh '{mesh.name}'"
        try:
            self.transport.send(mesh.addresses[rank], h, [])
        except SendFailed as e:
            if kind in (Kind.REDIRECT, Kind.PRUNE):
                log.debug("monarch_kernel: %s was not sent: %s", what, e)
            else:
                self._not_sent(mesh.addresses[rank], what, e)

    def prune(self, mesh: MeshRef, parent: int, call_id: int, rank: int, origin: str) -> None:
        self.send_control(mesh, parent, Kind.PRUNE, call_id, PruneInfo(rank), origin)

    def send_interrupt(self, mesh: MeshRef, rank: int, actor: str, ack_port: int | None) -> None:
        """KeyboardInterrupt in ``actor`` (every actor if empty) on ``rank``; ``ack_port``: a
        port of ours the rank answers once it delivered it."""
        me = self.network.answerable(self.inbox, mesh.addresses[rank])
        h = Header.control(Kind.INTERRUPT, me, mesh.id, [rank], actor=actor,
                           payload=None if ack_port is None else InterruptAck(me, ack_port))
        self.send_or_report(mesh.addresses[rank], h, [], f"an interrupt for rank {rank} of mesh '{mesh.name}'")

    def send_tree(self, mesh: MeshRef, ranks, kind: int, body: list | None = None, payload=None) -> None:
        """A control message (STOP, DEATH, REVIVE, MOVED) to ``ranks`` of ``mesh`` (live ones: the
        launcher's ``up & alive``) down the multicast tree: each rank passes it on to its
        subtree before acting on it, so this process connects to at most ``fanout`` of them
        however many there are."""
        ranks = list(ranks)
        if not ranks:
            return
        body = list(body or [])
        origin = self.network.answerable(self.inbox, mesh.addresses[ranks[0]])
        for sub in self.subtrees(mesh, ranks, self.fanout):
            h = Header.control(kind, origin, mesh.id, sub, fanout=self.fanout, payload=payload)
            if body:
                h.parts = [[0, Status.OK, len(body) - 1]]
            self.send_or_report(mesh.addresses[sub[0]], h, body,
                                f"a {Kind(kind).name} for ranks {sub[0]}-{sub[-1]} of mesh '{mesh.name}'")

    def pass_down(self, h: Header, body: list) -> None:
        """On a rank: send a tree control message on to this rank's subtree (``send_tree``)."""
        member = self.memberships.get(h.mesh)
        if member is None or len(h.ranks) < 2 or h.ranks[0] != member[1]:
            return
        mesh = member[0]
        for sub in split(h.ranks[1:], h.fanout or self.fanout):
            fwd = Header.forward(h, sub)
            self.send_or_report(mesh.addresses[sub[0]], fwd, body,
                                f"a {Kind(h.kind).name} for ranks {sub[0]}-{sub[-1]} of mesh '{mesh.name}'")

    def send_object(self, address: str, kind: int, mesh_id: str, obj) -> None:
        body = dumps(obj)
        me = self.network.answerable(self.inbox, address)
        h = Header.control(kind, me, mesh_id)
        h.parts = [[0, Status.OK, len(body) - 1]]
        self.send_or_report(address, h, body, f"a {Kind(kind).name} report")

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool:
        """Send a message nobody waits on; a failure is logged (once per peer), since there
        is no caller to raise it to."""
        try:
            self.transport.send(address, h, body)
            return True
        except SendFailed as e:
            self._not_sent(address, what, e)
            return False

    def _not_sent(self, address: str, what: str, e: SendFailed) -> None:
        if address not in self._unsent_reported:
            self._unsent_reported.add(address)
            log.error("monarch_kernel: %s was not sent: %s", what, e)

    # ------------------------------------------------------------ answers and ports

    def send_reply(self, st, origin: str, call_id: int, me: int, mesh_id: str = "", direct=None) -> None:
        """``direct``: a ``ReplyInfo``, the answering actor's own TCP inbox."""
        self.send_parts(st.reply_to, st.to_node, st.parts, origin, call_id, me, mesh_id, direct)

    def send_parts(self, reply_to: str, to_node: bool, parts: list, origin: str, call_id: int, me: int,
                   mesh_id: str, direct) -> None:
        """The answer (``parts``) to call ``call_id`` made at ``origin``, to ``reply_to``: the
        caller, or (``to_node``) the tree node that gathers it."""
        h = Header.reply(call_id, origin, reply_to, mesh_id, me, to_node, direct)
        body = join_parts(h, parts)
        try:
            self.transport.send(reply_to, h, body)
        except SendFailed as e:
            self._send_later(reply_to, h, body, f"the answer to call {call_id} from rank {me}", e)

    def _send_later(self, address: str, h: Header, body: list, what: str, e: SendFailed,
                    wait: float = RESEND_FIRST_S, waited: float = 0.0) -> None:
        """An answer its caller waits for is not dropped on a failure that may pass (this
        process out of file descriptors for a moment, the caller's queue full): it is sent
        again from the IO thread, waiting longer each time, for ``RESEND_S``; then reported."""
        if waited >= RESEND_S:
            self._not_sent(address, f"{what} (tried for {waited:.0f} s)", e)
            return

        def again() -> None:
            try:
                self.transport.send(address, h, body, block=False)
            except SendFailed as e2:
                self._send_later(address, h, body, what, e2, min(1.0, wait * 2), waited + wait)

        self.io.call_soon(self.io.loop.call_later, wait, again)

    def send_port(self, address: str, port_id: int, part: Part, mesh_id: str | None = None) -> None:
        """Deliver one value to a port opened by the process at ``address``; ``mesh_id``:
        a mesh that process belongs to, whose key signs the message (default: our own)."""
        address = self.network.reach(self.inbox.address, address)
        if self.inbox.owns(address):
            self.io.call_soon(self.ports.deliver, port_id, part)
            return
        # By default sign as a member of this process's mesh: whoever opened the port talks
        # to that mesh, so it holds its key even when the mesh is another job's (detached).
        # Every Runtime sets ``process_mesh`` (to its own mesh if no rank's mesh is set).
        me = self.network.answerable(self.inbox, address)
        h = Header.port(port_id, me, address, mesh_id or process_mesh[0].id)
        self.transport.send(address, h, join_parts(h, [part]))


def _host_part(address: str) -> str:
    """``tcp://10.0.0.2:5555`` -> ``10.0.0.2``: the host a TCP address is on."""
    return address[6:].rpartition(":")[0] if address[:6] == "tcp://" else address
