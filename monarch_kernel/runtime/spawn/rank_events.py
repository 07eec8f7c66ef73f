"""What the templates and the hosts' agents tell this process of the ranks they forked: a
rank's output, its heartbeats, its hello (it is up, or its bootstrap failed) and its exit, or
the end of the template or agent itself (every rank it forked dies with it).

It owns the index from a forker's pids to ranks; a death is recorded here (the mesh's
``alive``, its ``exited``) and handed to the supervision policy, which decides what it means.
It starts and ends nothing.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import TYPE_CHECKING, Protocol

from ..errors import ActorError
from ..failure import DeathInfo
from ..wire.envelope import Part, Status
from . import oom_killer
from .host_messages import MalformedMessage, RankHello
from .owned_mesh import OwnedMesh
from .rank_remains import remove_inboxes

if TYPE_CHECKING:
    from ..net.inbox import Inbox
    from ..wire.auth import DropCounts


class DeathPolicy(Protocol):
    """What a recorded death is handed to: the supervision policy (``calls/supervision.py``,
    a room above this one, which spawn/ never imports)."""

    def on_death(self, om: OwnedMesh, rank: int, info: DeathInfo, on_purpose: bool = False) -> None: ...

    def forget_hosted(self, mesh_id: str) -> None: ...


class Reader(Protocol):
    """What reads the main inbox: the receiver (``net/receiver.py``)."""

    def drain(self, inbox: Inbox) -> None: ...


class RankEvents:
    """Every method runs on the IO thread."""

    def __init__(self, *, meshes: dict[str, OwnedMesh], supervision: DeathPolicy, receiver: Reader, inbox: Inbox,
                 drops: DropCounts):
        """``meshes``: the meshes this process spawned (mesh id -> OwnedMesh); ``receiver``
        and ``inbox``: what a rank's last answers are read from before its death counts."""
        self.meshes = meshes
        self.supervision = supervision
        self.receiver = receiver
        self.inbox = inbox
        self.drops = drops
        self.pid_index: dict[tuple[str, int], tuple[OwnedMesh, int]] = {}  # (source, pid) -> rank
        self.oom = oom_killer.OomKiller()  # names a local rank's SIGKILL by the out-of-memory killer

    def of(self, source: str) -> SourceEvents:
        """What one template or agent (``source``, its id) tells, tagged with it."""
        return SourceEvents(self, source)

    def forked(self, om: OwnedMesh, rank: int, source: str, pid: int) -> None:
        om.pids[rank] = pid
        self.pid_index[(source, pid)] = (om, rank)
        self.oom.forked(pid, local=om.links is None)

    def fork_failed(self, om: OwnedMesh, rank: int, why: str) -> None:
        """The template could not make the rank (a limit was reached): it dies, saying why."""
        if rank in om.alive:
            self.died(om, rank, DeathInfo(om.ref.name, rank, 0, om.ref.hosts[rank], None, None, [why], om.stopping))

    def on_output(self, source: str, pid: int, fd: int, data: bytes) -> None:
        entry = self.pid_index.get((source, pid))
        if entry is not None and fd in (1, 2):
            om, r = entry
            om.readers[r][fd - 1].feed(data)

    def on_beats(self, source: str, pids) -> None:
        now = time.monotonic()
        for pid in pids:
            entry = self.pid_index.get((source, pid))
            if entry is not None:
                om, r = entry
                om.last_beat[r] = now

    def on_hello(self, frame: bytes) -> None:
        """A rank is up (its ``RankHello``); a failed bootstrap fails the spawn (or restart)
        with its traceback; the rank stays up until it is stopped."""
        try:
            hello = RankHello.decode(frame)
        except MalformedMessage:
            self.drops.count("malformed")
            return
        om = self.meshes.get(hello.mesh)
        rank = hello.rank
        if om is None or rank in om.up or rank not in om.alive:
            return
        failed = hello.failed_status == Status.RAISED
        err = _bootstrap_error(om.ref.name, rank, Part(rank, Status.RAISED, hello.failed_frames)) if failed else None
        if err is not None and not om.ready.done():
            om.ready.set_exception(err)
        om.up.add(rank)
        om.last_beat[rank] = time.monotonic()
        if len(om.up) == om.ref.size and not om.ready.done():
            om.ready.set_result(True)
        back = om.restarting.pop(rank, None)
        if back is not None and err is not None:
            back.set_exception(err)
        elif back is not None:
            back.set_result(True)

    def on_exit(self, pid: int | None, status: int | None, source: str = sys.executable, why: str = "") -> None:
        """A rank forked by ``source`` (a template's id, or a host's link id) exited; pid
        None: ``source`` itself is gone, and every rank it forked with it (``why`` says how)."""
        if pid is None:
            self._source_gone(source, why)
            return
        entry = self.pid_index.pop((source, pid), None)
        if entry is None:
            return
        om, r = entry
        assert status is not None  # the template reports a rank's exit with its wait status
        remove_inboxes(om.ref.addresses[r])
        self.receiver.drain(self.inbox)  # answers it sent just before dying still count
        info = DeathInfo.from_status(om.ref.name, r, pid, om.ref.hosts[r], status, om.readers[r][1].tail)
        info.stopped, info.oom = om.stopping, self.oom.words(pid, om.links is None, info.signal)
        self.died(om, r, info)

    def _source_gone(self, source: str, why: str) -> None:
        for om in list(self.meshes.values()):
            ranks = sorted(r for r in om.alive if source_of(om, r) == source)
            if not ranks:
                continue
            if not om.ready.done():
                om.stopping = True  # it never came up: its spawner hears (ready fails), nobody else
            link = next((lk for lk in om.links if lk.id == source), None) if om.links is not None else None
            for r in ranks:
                rank_pid = om.pids[r]
                if rank_pid is not None:
                    self.pid_index.pop((source, rank_pid), None)
                if link is not None:
                    reason = f"(its host {link.host} is gone: {why})"
                elif rank_pid is not None:
                    reason = "(its host process, the template, exited)"
                else:
                    python = source.rsplit("#", 1)[0]
                    reason = (f"(the template running {python} exited before forking it: can {python} "
                              "start and import monarch_kernel?)")
                self.died(om, r, DeathInfo(om.ref.name, r, rank_pid or 0, om.ref.hosts[r], None,
                                           signal.SIGKILL if rank_pid is not None or link else None,
                                           [reason], om.stopping))

    def died(self, om: OwnedMesh, rank: int, info: DeathInfo) -> None:
        """Record ``rank``'s death and hand it to the policy; the mesh is forgotten once a
        stopped one has no rank left."""
        om.alive.discard(rank)
        killed = om.dying.pop(rank, None)
        self.supervision.on_death(om, rank, info, on_purpose=killed is not None)
        if killed is not None:
            killed.set_result(True)
        if not om.alive:
            om.exited.set_result(True)
            if om.stopping:  # nothing will call it again: forget it
                self.meshes.pop(om.ref.id, None)
                self.supervision.forget_hosted(om.ref.id)


def source_of(om: OwnedMesh, rank: int) -> str:
    """What forked ``rank``: a local template or a host's agent (its id)."""
    if om.links is not None:
        return om.links[rank].id
    return om.sources[rank] or om.python


class SourceEvents:
    """What one template (or one host's agent) tells, tagged with its source."""

    def __init__(self, events: RankEvents, source: str):
        self.events, self.source = events, source

    def exited(self, pid: int | None, status: int | None, why: str = "") -> None:
        self.events.on_exit(pid, status, self.source, why)

    def output(self, pid: int, fd: int, data: bytes) -> None:
        self.events.on_output(self.source, pid, fd, data)

    def hello(self, pid: int, hello: bytes) -> None:
        self.events.on_hello(hello)

    def beats(self, pids) -> None:
        self.events.on_beats(self.source, pids)


def _bootstrap_error(mesh: str, rank: int, part: Part) -> ActorError:
    failure = part.load()
    err = ActorError(failure, f"the bootstrap function of mesh '{mesh}' raised on rank {rank} (pid {failure.pid} "
                              f"on {failure.host}): {failure.type_name}: {failure.message}\n\n"
                              f"Traceback from rank {rank}:\n{failure.traceback.rstrip()}")
    err.__cause__ = failure.exception()
    return err
