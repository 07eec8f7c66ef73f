"""An endpoint's failure as its answer: the failure Part that names the actor, and what a
failure nobody waits for does (a broadcast one stops the actor; a told one is reported to
the mesh's owner).  Kept apart from the server, which runs the endpoints.
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import TYPE_CHECKING

from .. import gpus
from ..context import MeshRef, actor_name, actor_path
from ..errors import ActorError
from ..failure import MeshFailure, RemoteFailure
from ..wire.envelope import Header, Kind, Part, Status
from ..wire.serialize import dumps

if TYPE_CHECKING:
    from collections.abc import Callable

    from .actor_slots import ActorSlot


def failure_part(me: int, actor: str, method: str, exc: BaseException) -> Part:
    """``exc`` as the answer of ``actor`` (its id); the failure names the actor mesh as
    the user named it, as Monarch's ``ActorError`` does.  If the report itself fails (a
    ``str()`` that raises...), a plain-text failure answers anyway: a call never hangs."""
    name = actor_name(actor)
    try:
        part = Part(me, Status.RAISED, dumps(RemoteFailure.capture(me, name, method, exc)))
        gpus.release_after_oom(exc)  # before the caller hears: it may retry on a GPU shared with us
        return part
    except Exception as e:
        kind = type(exc).__qualname__
        said = f"{kind} (its report failed: {type(e).__name__}: {e})"
        failure = RemoteFailure(me, name, method, kind, said, said, socket.gethostname(), os.getpid())
        return Part(me, Status.RAISED, [pickle.dumps(failure, 5)])


def stop_if_unobserved(slot: ActorSlot, h: Header, part: Part) -> None:
    """An exception escaped an endpoint called with ``broadcast`` (nobody waits for its
    answer): as in Monarch the actor stops, and every later call to it fails with this.
    The caller's runtime still reports the failure to the actor mesh's owner."""
    if h.payload is not None and h.kind == Kind.CALL and h.payload.broadcast and slot.failure is None:
        slot.failure = part


def report_told(memberships: dict[str, tuple[MeshRef, int]], report_failure: Callable[[str, MeshFailure], None],
                h: Header, me: int, part: Part, slot: ActorSlot | None) -> None:
    """A told endpoint raised: no caller waits for its answer, so the mesh's owner hears, as of an abort."""
    member = memberships.get(h.mesh)
    if member is not None:
        failure, cls = part.load(), type(slot.instance) if slot is not None and slot.instance is not None else None
        path = actor_path(None, f"{cls.__module__}.{cls.__qualname__}", h.actor, me, member[0].dims) if cls else ""
        report_failure(h.mesh, MeshFailure(member[0].name, me, str(ActorError(failure)), remote=failure, actor=path))
