"""Making calls from this process: sending a call down the multicast tree, the small control
messages around it, answers going back up, interrupts and port values.  A send that cannot
go fails the call at once (``Status.UNSENT``) or, with nobody to tell, is said on stderr.

A mixin of ``Runtime``; it uses the runtime's transport, calls in flight and ports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .calls import PendingCall, synthetic_part
from .context import MeshRef, process_mesh
from .envelope import Header, Kind, Mode, Part, Status, join_parts, split_parts
from .failure import SendFailed
from .inbox import actor_address
from .serialize import dumps
from .tree import split

if TYPE_CHECKING:
    from .actors import ActorSlot
    from .auth import Signer
    from .failure import DeathInfo
    from .inbox import Inbox
    from .io_thread import IOThread
    from .ports import PortTable
    from .transport import Transport
    from .tree import NodeTable


class Calling:
    """How a process calls others (mixed into ``Runtime``)."""

    if TYPE_CHECKING:  # what Runtime.__init__ and the Receiving mixin provide
        address: str
        inbox: Inbox
        io: IOThread
        signer: Signer
        transport: Transport
        fanout: int
        calls: dict[int, PendingCall]
        dead: dict[tuple[str, int], DeathInfo]
        actors: dict[str, ActorSlot]
        memberships: dict[str, tuple[MeshRef, int]]
        nodes: NodeTable
        ports: PortTable
        self_mesh: MeshRef
        _ids: Iterator[int]
        _unsent_reported: set[str]
        direct: dict[tuple[str, int, str], str]

        def reply_inbox(self) -> Inbox: ...
        def from_address(self, inbox: Inbox, dest: str) -> str: ...
        def reach(self, address: str) -> str: ...

    def call(self, mesh: MeshRef, actor: str, method: str, ranks: list[int], body: list,
             *, kind: int = Kind.CALL, mode: int = Mode.GATHER, slice_info=None,
             on_part=None, fanout: int | None = None, callbacks: bool = False,
             segments: list | None = None, extra=None) -> PendingCall:
        """Send ``body`` (an encoded part) to ``ranks`` of ``mesh`` through the tree.

        Replies come back to the calling thread's own inbox, unless they are consumed by
        callbacks (``on_part``, or ``callbacks=True``), which run on the IO thread.
        ``extra``: options of a SPAWN (``{"main_thread": True}``), in the slice info's place.
        """
        fanout = fanout or self.fanout
        self._check_size(body, f"the arguments of {method}")
        alive = [r for r in ranks if (mesh.id, r) not in self.dead]
        inbox = self.inbox if (on_part is not None or callbacks) else self.reply_inbox()
        origin = self.from_address(inbox, mesh.addresses[0]) if mesh.addresses else inbox.address
        h = Header(kind, next(self._ids), origin, origin, mesh.id, actor, method,
                   [], fanout, mode, False, 0, [], slice_info if extra is None else extra)
        h.parts = [[-1, Status.OK, len(body) - 1]]
        call = PendingCall(self, h, mesh, alive, body, on_part)
        call.inbox = inbox
        call.segments = segments
        call.remaining.update(ranks)
        self.calls[h.call_id] = call
        for r in ranks:
            if (mesh.id, r) in self.dead:
                call.add([synthetic_part(r, Status.DIED, self.dead[(mesh.id, r)])])
        for sub in split(alive, fanout):
            h.ranks = sub
            try:
                self.transport.send(self.target(mesh, sub[0], kind, actor), h, body)
            except SendFailed as e:  # the caller hears at once; the rest of the call goes on
                call.add([synthetic_part(r, Status.UNSENT, f"{e}") for r in sub])
        h.ranks = []
        late = [r for r in alive if (mesh.id, r) in self.dead]
        if late:  # died while we were sending; the death handler may have missed this call
            def fail_late() -> None:
                for r in late:
                    call.rank_died(r, self.dead[(mesh.id, r)])
            self.io.call_soon(fail_late)
        return call

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

    def send_control(self, mesh: MeshRef, rank: int, kind: int, call_id: int = 0, extra=None,
                     origin: str | None = None) -> None:
        """A small message to a rank; ``origin`` names the inbox a call was made from, which
        is how ranks file the calls they serve."""
        origin = origin or self.from_address(self.inbox, mesh.addresses[rank])
        h = Header(kind, call_id, origin, origin, mesh.id, ranks=[rank], extra=extra)
        self.send_or_report(mesh.addresses[rank], h, [], f"{Kind(kind).name} for rank {rank} of mesh '{mesh.name}'")

    def send_tree(self, mesh: MeshRef, ranks, kind: int, body: list | None = None, extra=None) -> None:
        """A control message (STOP, DEATH, REVIVE) to ``ranks`` of ``mesh`` down the multicast
        tree: each rank passes it on to its subtree before acting on it, so this process
        connects to at most ``fanout`` of them however many there are."""
        ranks = [r for r in ranks if (mesh.id, r) not in self.dead]
        if not ranks:
            return
        body = list(body or [])
        origin = self.from_address(self.inbox, mesh.addresses[ranks[0]])
        for sub in split(ranks, self.fanout):
            h = Header(kind, 0, origin, origin, mesh.id, ranks=sub, fanout=self.fanout, extra=extra)
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
            fwd = Header(h.kind, h.call_id, h.origin, h.reply_to, h.mesh, h.actor, h.method, sub, h.fanout,
                         h.mode, h.resend, h.hop, h.parts, h.extra)
            self.send_or_report(mesh.addresses[sub[0]], fwd, body,
                                f"a {Kind(h.kind).name} for ranks {sub[0]}-{sub[-1]} of mesh '{mesh.name}'")

    def send_object(self, address: str, kind: int, mesh_id: str, obj) -> None:
        body = dumps(obj)
        me = self.from_address(self.inbox, address)
        h = Header(kind, 0, me, me, mesh_id)
        h.parts = [[0, Status.OK, len(body) - 1]]
        self.send_or_report(address, h, body, f"a {Kind(kind).name} report")

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool:
        """Send a message nobody waits on; a failure is said on stderr (once per peer), since
        there is no caller to raise it to."""
        try:
            self.transport.send(address, h, body)
            return True
        except SendFailed as e:
            if address not in self._unsent_reported:
                self._unsent_reported.add(address)
                logging.getLogger(__name__).error("monarch_kernel: %s was not sent: %s", what, e)
            return False

    def _on_reply(self, h: Header, body: list) -> None:
        if h.extra and type(h.extra) is list and len(h.extra) == 3 and h.extra[0] == "direct" and h.ranks:
            addr = h.extra[2]
            if isinstance(addr, str) and addr.startswith("tcp://"):
                self.direct[(h.mesh, h.ranks[0], h.extra[1])] = addr  # that actor's own inbox, from now on
        parts = split_parts(h, body)
        if h.hop == 0:
            call = self.calls.get(h.call_id)
            if call is not None and call.inbox is not None and (
                    h.origin == call.inbox.address or h.origin == call.inbox.net_address):
                call.add(parts)
            return
        st = self.nodes.add((h.origin, h.call_id), h.ranks[0], parts)
        if st is not None:
            member = self.memberships.get(h.mesh)
            self._send_reply(st, h.origin, h.call_id, member[1] if member else -1, h.mesh)

    def _send_reply(self, st, origin: str, call_id: int, me: int, mesh_id: str = "", direct=None) -> None:
        """``direct``: ``["direct", actor, address]``, the answering actor's own TCP inbox."""
        h = Header(Kind.REPLY, call_id, origin, st.reply_to, mesh_id, ranks=[me], hop=1 if st.to_node else 0,
                   extra=direct)
        body = join_parts(h, st.parts)
        self.send_or_report(st.reply_to, h, body, f"the answer to call {call_id} from rank {me}")

    def _check_size(self, frames: list, what: str) -> None:
        limit = self.signer.max_frame
        for f in frames:
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            if n > limit:
                raise ValueError(
                    f"{what} need a {n}-byte frame, over the {limit}-byte limit the receiver "
                    f"would drop; raise MONARCH_KERNEL_MAX_FRAME (bytes) before spawning"
                )

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
            me = self.from_address(self.inbox, mesh.addresses[r])
            h = Header(Kind.INTERRUPT, 0, me, me, mesh.id, actor, ranks=[r],
                       extra=None if port_id is None else [me, port_id])
            self.send_or_report(mesh.addresses[r], h, [], f"an interrupt for rank {r} of mesh '{mesh.name}'")
        if port_id is None:
            return True
        ok = not alive or done.wait(wait)
        self.ports.close(port_id)
        return ok

    def interrupt_actor(self, actor_id: str) -> bool:
        """In this process: KeyboardInterrupt in ``actor_id``'s running sync endpoint (any
        thread may ask; used when the IO thread itself may be held by a debugger)."""
        slot = self.actors.get(actor_id)
        return slot.interrupt() if slot is not None else False

    def send_port(self, address: str, port_id: int, part: Part, mesh_id: str | None = None) -> None:
        """Deliver one value to a port opened by the process at ``address``; ``mesh_id``:
        a mesh that process belongs to, whose key signs the message (default: our own)."""
        address = self.reach(address)
        if address == self.address or address == self.inbox.net_address:
            self.io.call_soon(self.ports.deliver, port_id, part)
            return
        # By default sign as a member of this process's mesh: whoever opened the port talks
        # to that mesh, so it holds its key even when the mesh is another job's (detached).
        me = self.from_address(self.inbox, address)
        h = Header(Kind.PORT, port_id, me, address, mesh_id or (process_mesh[0] or self.self_mesh).id)
        self.transport.send(address, h, join_parts(h, [part]))
