"""A process's network without sockets or processes, for tests that build one runtime part
alone (dask's ``test_worker_state_machine.py`` does the same for its worker): an IO thread
that the test drives by hand, inboxes that are queues, a transport that seals each message
with the real signer and keeps it, and a receiver that records what it was asked to read.

Only the network is fake: the parts under test (Outbox, Caller, Gathering, Server, the
actors' lives, the supervision policy; the launcher in ``fake_hosts.py``) are the runtime's
own, built with the keyword constructors the runtime uses.  ``Parts`` builds them over these
fakes.
Tested in tests/runtime/test_fake_net.py.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import zmq

from monarch_kernel.runtime.calls.actor_lives import ActorLives
from monarch_kernel.runtime.calls.answers import Answers
from monarch_kernel.runtime.calls.caller import Caller
from monarch_kernel.runtime.calls.gathering import Gathering
from monarch_kernel.runtime.calls.outbox import Outbox
from monarch_kernel.runtime.calls.server import Server
from monarch_kernel.runtime.calls.supervision import SupervisionPolicy
from monarch_kernel.runtime.context import MeshRef
from monarch_kernel.runtime.errors import SendFailed
from monarch_kernel.runtime.failure import DeathInfo, MeshFailure
from monarch_kernel.runtime.hooks import Hooks
from monarch_kernel.runtime.net.ports import PortTable
from monarch_kernel.runtime.wire.auth import DropCounts, Signer
from monarch_kernel.runtime.wire.envelope import Header, Kind

KEY = b"k" * 32


class FakeLoop:
    """The part of an asyncio loop the runtime's parts use: ``call_soon``, ``call_later``
    (on the real clock: a grace counted from ``time.monotonic()`` still means what it says),
    and readers, which are only recorded."""

    def __init__(self):
        self.soon: collections.deque = collections.deque()
        self.timers: list = []  # heap of (due, n, fn, args)
        self.readers: dict[int, tuple] = {}
        self._n = itertools.count()

    def call_soon(self, fn, *args) -> None:
        self.soon.append((fn, args))

    def call_later(self, delay: float, fn, *args) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self._n), fn, args))

    def add_reader(self, fd: int, fn, *args) -> None:
        self.readers[fd] = (fn, args)

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)


class FakeIO:
    """The IO thread, driven by the test: ``call_soon`` queues, ``run`` runs at once, and
    ``turn()`` runs what is queued and what is due, as the IO thread, in the calling thread.
    A lock makes any thread's ``turn`` the only IO thread at a time."""

    def __init__(self):
        self.loop = FakeLoop()
        self.thread = None  # the transport's ``use_io`` is never called with it
        self._lock = threading.RLock()
        self._ident: int | None = None

    def is_current(self) -> bool:
        return self._ident == threading.get_ident()

    def call_soon(self, fn, *args) -> None:
        self.loop.call_soon(fn, *args)

    def run(self, fn, *args, timeout: float | None = None):
        with self._as_io():
            return fn(*args)

    def turn(self) -> int:
        """Run what is queued and every timer that is due; how many callbacks ran."""
        ran = 0
        with self._as_io():
            loop = self.loop
            while loop.soon or (loop.timers and loop.timers[0][0] <= time.monotonic()):
                if loop.soon:
                    fn, args = loop.soon.popleft()
                else:
                    _due, _n, fn, args = heapq.heappop(loop.timers)
                fn(*args)
                ran += 1
        return ran

    def until(self, done, timeout: float = 10.0, what: str = "the condition") -> None:
        """Turn until ``done()`` holds; fails saying what it waited for after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            if not self.turn():
                time.sleep(0.005)

    class _AsIO:
        def __init__(self, io):
            self.io = io

        def __enter__(self):
            self.io._lock.acquire()
            self.before = self.io._ident
            self.io._ident = threading.get_ident()

        def __exit__(self, *exc):
            self.io._ident = self.before
            self.io._lock.release()

    def _as_io(self):
        return FakeIO._AsIO(self)


class FakeInbox:
    """An inbox as the parts see it: an address, a lease, and a queue of received frames.
    ``items`` and ``fds`` are a pipe's read end, so an actor's worker can poll it (nothing is
    ever written to the pipe: messages are handed to the server directly)."""

    def __init__(self, address: str):
        self.address = address
        self.net_address: str | None = None
        self.former: tuple = ()
        self.lease = threading.Lock()
        self.missed = False
        self.watched = False
        self.queue: collections.deque = collections.deque()
        self._r, self._w = os.pipe()
        self.items = [(self._r, zmq.POLLIN)]
        self.closed = False

    def fds(self) -> list[int]:
        return [self._r]

    def owns(self, address: str) -> bool:
        return address == self.address

    def ready(self, timeout_ms: int = 0) -> bool:
        return bool(self.queue)

    def recv(self):
        return self.queue.popleft() if self.queue else None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._r)
            os.close(self._w)


class FakeNetwork:
    """Where this process listens, as the parts ask it: every address answers for itself."""

    def __init__(self):
        self.inboxes: dict[str, FakeInbox] = {}
        self.curve = None
        self.net_address: str | None = None

    def answerable(self, inbox, peer: str) -> str:
        return inbox.address

    def reach(self, mine: str, address: str) -> str:
        return address

    def port_address(self, address: str) -> str:
        return address

    def job_ports_for(self, job_ports: dict, own: str, dest: str) -> dict:
        return dict(job_ports)

    def thread_inbox(self, base: str, n: int) -> FakeInbox:
        return self._inbox(f"{base}.t{n}")

    def actor_inbox(self, address: str) -> FakeInbox:
        return self._inbox(address)

    def _inbox(self, address: str) -> FakeInbox:
        inbox = self.inboxes[address] = FakeInbox(address)
        return inbox

    def close(self) -> None:
        for inbox in self.inboxes.values():
            inbox.close()


@dataclass
class Sent:
    """One message a part sent: where to, and what the peer reads (the header and body the
    real signer sealed, opened again, so that later changes to the sender's header object
    do not show)."""
    address: str
    header: Header
    body: list = field(default_factory=list)

    @property
    def kind(self) -> Kind:
        return Kind(self.header.kind)


class FakeTransport:
    """Sends by keeping: each message is sealed with the real signer and opened again, and
    kept in ``sent``.  ``down`` holds addresses a send to fails (``SendFailed``), as to a
    peer that is gone."""

    def __init__(self, signer: Signer):
        self.signer = signer
        self.sent: list[Sent] = []
        self.down: set[str] = set()
        self.forgotten: list[str] = []
        self.carried = False  # no out-of-cluster host's connection carries several ranks
        self.moved: dict[str, str] = {}  # old address -> new (a rank restarted on another host)
        self.owners: dict[str, str] = {}  # old address -> the moved rank's mesh
        self._lock = threading.Lock()

    def send(self, address: str, h: Header, body: list) -> None:
        address = self.moved.get(address, address)
        if address in self.down:
            raise SendFailed(f"{address} is down (a test said so)")
        header, got = self.signer.open(self.signer.seal(h, list(body)))
        with self._lock:
            self.sent.append(Sent(address, header, [bytes(memoryview(b)) for b in got]))

    def carrier(self, address: str) -> None:
        return None

    def forget(self, address: str) -> None:
        self.forgotten.append(address)

    def forward(self, old: str, new: str, owner: str = "") -> None:
        """As the real transport's: what is sent to ``old`` goes to ``new``, and so does what went to ``old``."""
        self.moved = {k: (new if v == old else v) for k, v in self.moved.items() if k != new}
        if old != new:
            self.moved[old] = new
            self.owners[old] = owner

    def unforward(self, addresses=(), owner: str = "") -> None:
        """As the real transport's: forwards from ``addresses``, and of mesh ``owner``, go."""
        drop = {a for a in addresses if a in self.moved} | {a for a, o in self.owners.items() if owner and o == owner}
        self.moved = {k: v for k, v in self.moved.items() if k not in drop}

    def forwards(self) -> dict[str, str]:
        return dict(self.moved)

    def take_to(self, address: str) -> list[Sent]:
        """What was sent to ``address`` since it was last taken (the rest stays)."""
        with self._lock:
            out = [s for s in self.sent if s.address == address]
            self.sent = [s for s in self.sent if s.address != address]
        return out

    def take(self, kind: int | None = None) -> list[Sent]:
        """What was sent since the last ``take`` (of ``kind`` only, if given; the rest stays)."""
        with self._lock:
            if kind is None:
                out, self.sent = self.sent, []
            else:
                out = [s for s in self.sent if s.header.kind == kind]
                self.sent = [s for s in self.sent if s.header.kind != kind]
        return out


class FakeReceiver:
    """Reading, as the parts ask for it: which inboxes the IO thread is to read (``watched``),
    drains asked for, and waits, which block on the completion itself (no inbox is read:
    the test hands messages to the parts)."""

    def __init__(self):
        self.watched: list = []
        self.unwatched: list = []
        self.drained: list = []

    def watch(self, inbox) -> None:
        self.watched.append(inbox)

    def unwatch(self, inbox) -> None:
        self.unwatched.append(inbox)

    def drain(self, inbox) -> None:
        self.drained.append(inbox)

    def read(self, inbox, limit: int, inline: bool) -> bool:
        return False

    def wait(self, completion, timeout: float | None, inbox=None) -> bool:
        return completion.wait(timeout)


def mesh(n: int, name: str = "m", owner: str = "ipc://ctl") -> MeshRef:
    """A mesh of ``n`` ranks at ``ipc://<name>.<rank>``, owned by ``owner``."""
    return MeshRef(f"id-{name}", name, (("x", n),), tuple(f"ipc://{name}.{r}" for r in range(n)), owner,
                   ("h",) * n)


def death(ref: MeshRef, rank: int) -> DeathInfo:
    return DeathInfo(ref.name, rank, 1000 + rank, "h", None, 9, [])


class Parts:
    """The runtime's calling and serving parts over the fakes, built as ``Runtime.__init__``
    builds them: one process at ``address``, a member of ``member_of`` (mesh, rank) if given.
    ``failures`` holds what was given to ``report_failure`` and ``unhandled``."""

    def __init__(self, address: str = "ipc://ctl", member_of: tuple[MeshRef, int] | None = None, fanout: int = 2,
                 owner: str | None = None):
        self.io = FakeIO()
        self.signer = Signer(KEY)
        self.drops = DropCounts()
        self.hooks = Hooks()
        self.ports = PortTable()
        self.network = FakeNetwork()
        self.transport = FakeTransport(self.signer)
        self.receiver = FakeReceiver()
        self.inbox = FakeInbox(address)
        self.memberships: dict = {} if member_of is None else {member_of[0].id: member_of}
        self.meshes: dict = {}
        self.failures: list[tuple[str, MeshFailure]] = []
        self.unhandled: list[MeshFailure] = []
        self.outbox = Outbox(io=self.io, transport=self.transport, network=self.network, inbox=self.inbox,
                             ports=self.ports, memberships=self.memberships, fanout=fanout)
        self.caller = Caller(outbox=self.outbox, io=self.io, network=self.network, receiver=self.receiver,
                             signer=self.signer, ports=self.ports, segments=None, report_failure=self.report_failure)
        self.gathering = Gathering(outbox=self.outbox, drops=self.drops, memberships=self.memberships)
        self.answers = Answers(outbox=self.outbox, gathering=self.gathering, signer=self.signer,
                               memberships=self.memberships, report_failure=self.report_failure)
        self.lives = ActorLives(answers=self.answers, caller=self.caller, receiver=self.receiver,
                                network=self.network, io=self.io, host="h", main_thread=None, meshes=self.meshes,
                                stop_mesh=lambda om: om.exited, report_failure=self.report_failure)
        self.server = Server(outbox=self.outbox, gathering=self.gathering, answers=self.answers, lives=self.lives,
                             memberships=self.memberships, network=self.network, address=address,
                             drops=self.drops, ports=self.ports, hooks=self.hooks)
        self.supervision = SupervisionPolicy(io=self.io, outbox=self.outbox, caller=self.caller, lives=self.lives,
                                             meshes=self.meshes, memberships=self.memberships, hooks=self.hooks,
                                             owner=owner, shutting_down=lambda: False)
        self.hooks.unhandled.install(self.unhandled.append)

    def report_failure(self, mesh_id: str, failure: MeshFailure) -> None:
        self.failures.append((mesh_id, failure))

    def deliver(self, sent: Sent, handler) -> None:
        """Hand one sent message to ``handler`` (a part's ``on_*``) as the peer would read it."""
        handler(sent.header, sent.body)

    def close(self, timeout: float = 10.0) -> None:
        """End the actors' workers (each closes its inbox as it ends), then the fake inboxes."""
        slots = list(self.lives.actors.values())
        for slot in slots:
            slot.stop()
        deadline = time.monotonic() + timeout
        for slot in slots:
            while slot.inbox is not None and not slot.inbox.closed and time.monotonic() < deadline:
                time.sleep(0.01)
        self.network.close()
        self.inbox.close()

