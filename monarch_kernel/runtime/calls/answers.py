"""How this process answers a call it served: the value pickled (or the failure it became),
sent straight back for a call made to this rank alone, merged into the tree's gathering
otherwise, and for a told call (nobody waits) only a failure, reported to the mesh's owner.

It sends through the outbox and the gathering it is given, never by another route; both the
server (endpoints) and the actors' lives (construction, stops) answer through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..wire.envelope import Header, Kind, Mode, Part, Status
from ..wire.payloads import ReplyInfo
from ..wire.serialize import describe_unpicklable, dumps
from .endpoint_failures import failure_part, report_told

if TYPE_CHECKING:
    from ..context import MeshRef
    from ..failure import MeshFailure
    from ..wire.auth import Signer
    from .actor_slots import ActorSlot
    from .gathering import Gathering
    from .outbox import Outbox


class Answers:
    def __init__(self, *, outbox: Outbox, gathering: Gathering, signer: Signer,
                 memberships: dict[str, tuple[MeshRef, int]], report_failure: Callable[[str, MeshFailure], None]):
        """``signer``: the frame limit a result must fit; ``report_failure``: where a told
        call's failure goes (the mesh's supervisor)."""
        self.outbox = outbox
        self.gathering = gathering
        self.signer = signer
        self.memberships = memberships
        self.report_failure = report_failure

    def complete(self, h: Header, me: int, part: Part, slot: ActorSlot | None) -> None:
        """Rank ``me``'s answer to call ``h``; ``slot``: the actor that answered (its own TCP
        inbox, if it has one, goes with the answer), None for a spawn or no actor."""
        if h.mode == Mode.TELL:  # nobody waits for it: only a failure is heard, by supervision
            if part.status == Status.RAISED:
                report_told(self.memberships, self.report_failure, h, me, part, slot)
            return
        direct = ReplyInfo(h.actor, slot.direct) if slot is not None and slot.direct else None
        if lone(h):
            self.outbox.send_parts(h.reply_to, False, [part], h.origin, h.call_id, me, h.mesh, direct)
            return
        self.gathering.answer(h, me, part, direct)

    def ok(self, me: int, actor: str, method: str, value) -> Part:
        """``value`` returned by ``actor.method`` on rank ``me``, as an answer: a failure if it
        cannot be pickled or would not fit a frame."""
        try:
            frames = dumps(value)
            if self.signer.oversized(frames):
                self.signer.check_size(frames, f"the result of {actor}.{method} on rank {me} would")
            return Part(me, Status.OK, frames)
        except ValueError as e:
            return failure_part(me, actor, method, e)
        except Exception as e:
            err = TypeError(f"the result of {actor}.{method} on rank {me} could not be pickled: "
                            f"{describe_unpicklable(value, e)}")
            return failure_part(me, actor, method, err)


def answered_slot(h: Header, actors: dict) -> ActorSlot | None:
    """The actor whose answer this is (a CALL's), for ``Answers.complete``."""
    return actors.get(h.actor) if h.kind == Kind.CALL else None


def lone(h: Header) -> bool:
    """A call the caller sent straight to one rank (forwarded GATHER calls have hop 1, and a
    TELL is never forwarded): it needs no tree state, since nothing can be redirected to it."""
    return h.hop == 0 and h.mode != Mode.DIRECT and len(h.ranks) == 1 and not h.resend
