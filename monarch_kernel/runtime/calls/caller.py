"""Making calls from this process: the calls in flight, sending a call down the multicast
tree, answers coming back, interrupts, and what this process knows of dead ranks.  A call
that cannot be sent fails at once (``Status.UNSENT``); a TELL that cannot be sent is
reported to the mesh's owner (``report_failure``).

It owns the calls in flight and the dead ranks; addressing and sending are the outbox's
(``outbox.py``).  It owns the threads' reply inboxes, where its calls' answers come back
(``ReplyInboxes``).  It is given the outbox, the IO thread, the network (threads' inboxes),
the receiver (which reads an ended thread's inbox), the signer (the frame limit), the ports
(interrupts' acknowledgements), the process's shared-memory segments, and ``report_failure``.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from ..context import MeshRef
from ..errors import SendFailed
from ..failure import DeathInfo, MeshFailure
from ..net.inbox import Inbox
from ..net.reply_inboxes import ReplyInboxes
from ..wire.envelope import Header, Kind, Mode, Part, Status, split_parts
from .outstanding import PendingCall, synthetic_part

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..net.ports import PortTable
    from ..net.receiver import Receiver
    from ..wire.auth import Signer
    from ..wire.segments import Segments
    from .outbox import Outbox


class Caller:
    def __init__(self, *, outbox: Outbox, io: IOThread, network: Network, receiver: Receiver, signer: Signer,
                 ports: PortTable, segments: Segments | None, report_failure: Callable[[str, MeshFailure], None]):
        self.outbox = outbox
        self.io = io
        self.signer = signer
        self.inbox = outbox.inbox  # the process's main inbox (read by the IO thread)
        self.ports = ports
        self.segments = segments
        self.report_failure = report_failure
        self.reply_inboxes = ReplyInboxes(io=io, network=network, main=self.inbox, watch=receiver.watch,
                                          in_use=self.uses)
        self.calls: dict[int, PendingCall] = {}
        self.dead: dict[tuple[str, int], DeathInfo] = {}
        self._ids = itertools.count(1)

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
        outbox = self.outbox
        fanout = fanout or outbox.fanout
        if self.signer.oversized(body):
            self.signer.check_size(body, f"the arguments of {method}")
        dead = self.dead
        alive = [r for r in ranks if (mesh.id, r) not in dead] if dead else list(ranks)
        inbox = self.inbox if (on_part is not None or callbacks) else self.reply_inboxes.mine()
        h = Header.call(kind, next(self._ids), outbox.origin(inbox, mesh), mesh.id, actor, method, body, fanout,
                        mode, slice_info if options is None else options)
        call = PendingCall(outbox=outbox, finished=self.done, header=h, mesh=mesh, ranks=alive, body=body,
                           on_part=on_part, inbox=inbox, segments=segments)
        call.remaining.update(ranks)
        self.calls[h.call_id] = call
        if len(alive) != len(ranks):
            for r in ranks:
                if (mesh.id, r) in dead:
                    call.add([synthetic_part(r, Status.DIED, dead[(mesh.id, r)])])
        send, target = outbox.send, outbox.target
        if len(alive) == 1:
            top = [alive]
        else:
            top = call.top = outbox.subtrees(mesh, alive, fanout)
        for sub in top:
            h.ranks = sub
            try:
                send(target(mesh, sub[0], kind, actor), h, body)
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

    def tell(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list, slice_info) -> None:
        """A CALL nobody waits for and nobody answers (``Mode.TELL``): no call is kept here and
        no reply comes back, so a stream of them costs each rank one message and this process
        one send per rank.  Sent straight to each rank, never forwarded: nothing is gathered,
        and no forwarder's death can lose it.  A rank whose endpoint raises reports to the
        mesh's owner itself; a rank it cannot be sent to is reported from here."""
        if self.signer.oversized(body):
            self.signer.check_size(body, f"the arguments of {method}")
        outbox = self.outbox
        h = Header.call(Kind.CALL, next(self._ids), outbox.origin(self.inbox, mesh), mesh.id, actor, method, body, 1,
                        Mode.TELL, slice_info)
        dead, send, target = self.dead, outbox.send, outbox.target
        for r in ranks:
            if dead and (mesh.id, r) in dead:
                continue  # its death was reported already; there is nothing left to tell
            h.ranks = [r]
            try:
                send(target(mesh, r, Kind.CALL, actor), h, body)
            except SendFailed as e:
                self.report_failure(mesh.id, MeshFailure(mesh.name, r, f"{method} never reached rank {r}: {e}"))
                return  # the first unreachable rank says it for the rest

    def on_reply(self, h: Header, body: list) -> None:
        """A REPLY at hop 0: answers to a call made here (hop 1 goes to ``Gathering.on_reply``)."""
        if h.payload is not None:
            self.outbox.learn_direct(h)
        call = self.calls.get(h.call_id)
        if call is not None and call.inbox is not None and (
                h.origin == call.inbox.address or h.origin == call.inbox.net_address
                or h.origin in call.inbox.former):
            call.add(split_parts(h, body))

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

    def pending_on(self, mesh_id: str) -> list[tuple[int, str, str, frozenset[int]]]:
        """Calls made from this process that ranks of ``mesh_id`` still owe answers to, oldest
        first: (call id, actor, method, the ranks still waited on)."""
        out = []
        for cid, call in list(self.calls.items()):
            if call.mesh.id == mesh_id:
                remaining = frozenset(call.remaining.copy())
                if remaining:
                    out.append((cid, call.header.actor, call.header.method, remaining))
        out.sort(key=lambda c: c[0])
        return out

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
        if ref is not None:
            self.outbox.forget_rank(ref, rank)
        observed = 0
        for call in list(self.calls.values()):
            if call.mesh.id == mesh_id and rank in call.remaining:
                observed += 1
                call.rank_died(rank, info)
        return observed

    def revived(self, mesh_id: str, rank: int) -> None:
        self.dead.pop((mesh_id, rank), None)

    def done(self, call: PendingCall) -> None:
        """``call`` has every answer: it leaves the table, and its shared-memory arguments are
        released.  Off the caller's critical path: freeing pages takes a while."""
        self.calls.pop(call.header.call_id, None)
        store = self.segments  # None only where no call can carry segments
        if call.segments and store is not None:
            # Every rank that answered has mapped its arguments; one that died never will.
            reuse = all(p.status != Status.DIED for p in call.parts.values())
            self.io.call_soon(store.release, call.segments, reuse)

    # ------------------------------------------------------------ interrupts

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
            self.outbox.send_interrupt(mesh, r, actor, port_id)
        if port_id is None:
            return True
        ok = not alive or done.wait(wait)
        self.ports.close(port_id)
        return ok

