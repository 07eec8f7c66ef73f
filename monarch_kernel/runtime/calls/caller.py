"""Making calls from this process: the calls in flight, sending a call down the multicast
tree, the small control messages around it, answers coming back, interrupts and port
values.  A send that cannot go fails the call at once (``Status.UNSENT``) or, with nobody to
tell, is logged once per peer.

It owns the calls in flight, what this process knows of dead ranks and the direct TCP
addresses actors on other hosts named.  It is given what it uses: the IO thread, the
transport (sending), the network (which of our addresses a peer can answer), the main
inbox, the signer (the frame limit), the ports, the process's memberships (mesh id -> (mesh,
my rank)), its shared-memory segments, and ``report_failure`` (an unreachable rank of a
TELL).  The receiver is built after the caller (it takes ``uses``): the composition hands it
over at once as ``Caller.receiver``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING

from ..context import MeshRef, process_mesh
from ..errors import SendFailed
from ..failure import DeathInfo, MeshFailure
from ..net.inbox import Inbox, actor_address
from ..wire.envelope import Header, Kind, Mode, Part, Status, join_parts, split_parts
from ..wire.payloads import InterruptAck, PruneInfo
from ..wire.serialize import dumps
from .outstanding import PendingCall, synthetic_part
from .tree import split, split_groups

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..net.ports import PortTable
    from ..net.receiver import Receiver
    from ..net.transport import Transport
    from ..wire.auth import Signer
    from ..wire.segments import Segments

log = logging.getLogger("monarch_kernel.runtime")


class Caller:
    def __init__(self, io: IOThread, transport: Transport, network: Network, inbox: Inbox, signer: Signer,
                 ports: PortTable, memberships: dict[str, tuple[MeshRef, int]], segments: Segments | None,
                 report_failure: Callable[[str, MeshFailure], None], fanout: int):
        self.io = io
        self.transport = transport
        self.network = network
        self.inbox = inbox  # the process's main inbox (read by the IO thread)
        self.signer = signer
        self.ports = ports
        self.memberships = memberships
        self.segments = segments
        self.report_failure = report_failure
        self.receiver: Receiver  # handed over by the composition right after it builds the receiver
        self.fanout = fanout
        self.calls: dict[int, PendingCall] = {}
        self.dead: dict[tuple[str, int], DeathInfo] = {}
        self.direct: dict[tuple[str, int, str], str] = {}  # (mesh, rank, actor) -> that actor's own TCP inbox
        self._ids = itertools.count(1)
        self._unsent_reported: set[str] = set()

    # ------------------------------------------------------------ calls

    def call(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list,
             *, kind: int = Kind.CALL, mode: int = Mode.GATHER, slice_info=None,
             on_part=None, fanout: int | None = None, callbacks: bool = False,
             segments: list | None = None, options=None) -> PendingCall:
        """Send ``body`` (an encoded part) to ``ranks`` of ``mesh`` through the tree.

        Replies come back to the calling thread's own inbox, unless they are consumed by
        callbacks (``on_part``, or ``callbacks=True``), which run on the IO thread.
        ``slice_info``: a CALL's ``CallInfo``; ``options``: a SPAWN's ``SpawnInfo``.
        """
        fanout = fanout or self.fanout
        if self.oversized(body):
            self.check_size(body, f"the arguments of {method}")
        dead = self.dead
        alive = [r for r in ranks if (mesh.id, r) not in dead] if dead else list(ranks)
        inbox = self.inbox if (on_part is not None or callbacks) else self.receiver.reply_inbox(self.inbox)
        origin = self.network.answerable(inbox, mesh.addresses[0]) if mesh.addresses else inbox.address
        h = Header.call(kind, next(self._ids), origin, mesh.id, actor, method, body, fanout, mode,
                        slice_info if options is None else options)
        call = PendingCall(self, h, mesh, alive, body, on_part)
        call.inbox = inbox
        call.segments = segments
        call.remaining.update(ranks)
        self.calls[h.call_id] = call
        if len(alive) != len(ranks):
            for r in ranks:
                if (mesh.id, r) in dead:
                    call.add([synthetic_part(r, Status.DIED, dead[(mesh.id, r)])])
        send = self.transport.send
        if len(alive) == 1:
            top = [alive]
        else:
            top = call.top = self.subtrees(mesh, alive, fanout)
        for sub in top:
            h.ranks = sub
            try:
                send(self.target(mesh, sub[0], kind, actor), h, body)
            except SendFailed as e:  # the caller hears at once; the rest of the call goes on
                call.add([synthetic_part(r, Status.UNSENT, f"{e}") for r in sub])
        h.ranks = []
        late = [r for r in alive if (mesh.id, r) in dead] if dead else ()
        if late:  # died while we were sending; the death handler may have missed this call
            def fail_late() -> None:
                for r in late:
                    call.rank_died(r, dead[(mesh.id, r)])
            self.io.call_soon(fail_late)
        return call

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

    def tell(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list, slice_info) -> None:
        """A CALL nobody waits for and nobody answers (``Mode.TELL``): no call is kept here and
        no reply comes back, so a stream of them costs each rank one message and this process
        one send per rank.  Sent straight to each rank, never forwarded: nothing is gathered,
        and no forwarder's death can lose it.  A rank whose endpoint raises reports to the
        mesh's owner itself; a rank it cannot be sent to is reported from here."""
        if self.oversized(body):
            self.check_size(body, f"the arguments of {method}")
        origin = self.network.answerable(self.inbox, mesh.addresses[0]) if mesh.addresses else self.inbox.address
        h = Header.call(Kind.CALL, next(self._ids), origin, mesh.id, actor, method, body, 1, Mode.TELL, slice_info)
        dead, send = self.dead, self.transport.send
        for r in ranks:
            if dead and (mesh.id, r) in dead:
                continue  # its death was reported already; there is nothing left to tell
            h.ranks = [r]
            try:
                send(self.target(mesh, r, Kind.CALL, actor), h, body)
            except SendFailed as e:
                self.report_failure(mesh.id, MeshFailure(mesh.name, r, f"{method} never reached rank {r}: {e}"))
                return  # the first unreachable rank says it for the rest

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

    def on_reply(self, h: Header, body: list) -> None:
        """A REPLY at hop 0: answers to a call made here (hop 1 goes to ``Gathering.on_reply``)."""
        if h.payload is not None:
            self.learn_direct(h)
        call = self.calls.get(h.call_id)
        if call is not None and call.inbox is not None and (
                h.origin == call.inbox.address or h.origin == call.inbox.net_address
                or h.origin in call.inbox.former):
            call.add(split_parts(h, body))

    def learn_direct(self, h: Header) -> None:
        """A REPLY may name the answering actor's own TCP inbox: its calls go there from now on."""
        if h.payload is not None and h.ranks:
            self.direct[(h.mesh, h.ranks[0], h.payload.actor)] = h.payload.address

    def on_not_received(self, h: Header, _body: list) -> None:
        call = self.calls.get(h.call_id)
        if call is not None and h.ranks:
            call.not_received(h.ranks[0])

    def busy_ranks(self, mesh_id: str) -> dict[int, int]:
        """Ranks of ``mesh_id`` that calls made from this process wait on, and how many each."""
        busy: dict[int, int] = {}
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id:
                for r in call.remaining:
                    busy[r] = busy.get(r, 0) + 1
        return busy

    def uses(self, inbox: Inbox) -> bool:
        """Whether a call in flight waits for answers at ``inbox``."""
        return any(c.inbox is inbox for c in list(self.calls.values()))

    # ------------------------------------------------------------ deaths

    def rank_died(self, mesh_id: str, rank: int, info: DeathInfo, ref: MeshRef | None) -> int:
        """On the IO thread: fail this process's calls to the rank and repair their trees.
        Returns how many calls were waiting on it (and so now hold a ``ProcessDied``)."""
        if (mesh_id, rank) in self.dead:
            return 0
        self.dead[(mesh_id, rank)] = info
        if ref is not None and 0 <= rank < len(ref.addresses):
            transport = self.transport
            transport.forget(ref.addresses[rank])  # every thread drops its sockets to it
            for key in [k for k in self.direct if k[0] == mesh_id and k[1] == rank]:
                transport.forget(self.direct.pop(key))
        observed = 0
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id and rank in call.remaining:
                observed += 1
                call.rank_died(rank, info)
        return observed

    def revived(self, mesh_id: str, rank: int) -> None:
        self.dead.pop((mesh_id, rank), None)

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

    def send_tree(self, mesh: MeshRef, ranks, kind: int, body: list | None = None, payload=None) -> None:
        """A control message (STOP, DEATH, REVIVE) to ``ranks`` of ``mesh`` down the multicast
        tree: each rank passes it on to its subtree before acting on it, so this process
        connects to at most ``fanout`` of them however many there are."""
        ranks = [r for r in ranks if (mesh.id, r) not in self.dead]
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
            self._not_sent(reply_to, f"the answer to call {call_id} from rank {me}", e)

    def oversized(self, frames: list) -> bool:
        """Whether a frame of ``frames`` is over the limit receivers drop (``check_size`` says how)."""
        limit = self.signer.max_frame
        for f in frames:
            if (f.nbytes if type(f) is memoryview else len(f)) > limit:
                return True
        return False

    def check_size(self, frames: list, what: str) -> None:
        limit = self.signer.max_frame
        for f in frames:
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            if n > limit:
                raise ValueError(
                    f"{what} need a {n}-byte frame, over the {limit}-byte limit the receiver "
                    f"would drop; raise MONARCH_KERNEL_MAX_FRAME (bytes) before spawning"
                )

    # ------------------------------------------------------------ interrupts and ports

    def interrupt(self, mesh: MeshRef, ranks, actor: str = "", wait: float = 0.0) -> bool:
        """KeyboardInterrupt in whatever ``actor`` (or every actor) runs on those ranks.

        ``wait``: seconds to wait until every rank has delivered it (what must happen next
        may depend on it, e.g. resuming a rank stopped in a debugger); True if they all did.
        """
        alive = [r for r in ranks if (mesh.id, r) not in self.dead]
        acked: set[int] = set()
        done = threading.Event()
        port_id = None
        if wait > 0:
            def ack(part: Part) -> None:
                acked.add(part.rank)
                if acked >= set(alive):
                    done.set()

            port_id = self.ports.open(ack, once=False)
        for r in alive:
            me = self.network.answerable(self.inbox, mesh.addresses[r])
            h = Header.control(Kind.INTERRUPT, me, mesh.id, [r], actor=actor,
                               payload=None if port_id is None else InterruptAck(me, port_id))
            self.send_or_report(mesh.addresses[r], h, [], f"an interrupt for rank {r} of mesh '{mesh.name}'")
        if port_id is None:
            return True
        ok = not alive or done.wait(wait)
        self.ports.close(port_id)
        return ok

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
