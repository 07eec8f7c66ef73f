"""Same-host datagram links (runtime/datagram.py): order, pieces, a full peer queue, an inbox
that is not there yet, and bad datagrams, between the runtime's own inboxes and transport
in this process (real sockets, real signing)."""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import threading
import time

import pytest
import zmq

from monarch_kernel.runtime import config
from monarch_kernel.runtime.auth import Dropped, Signer
from monarch_kernel.runtime.datagram import DGRAM_MAX, path_of
from monarch_kernel.runtime.envelope import Header
from monarch_kernel.runtime.failure import SendFailed
from monarch_kernel.runtime.inbox import Inbox
from monarch_kernel.runtime.io_thread import IOThread
from monarch_kernel.runtime.kinds import Kind
from monarch_kernel.runtime.transport import Transport

pytestmark = pytest.mark.timeout(60)


class Wire:
    """A transport and inboxes of this process, as a runtime composes them."""

    def __init__(self, tmp_path, queue_limit: int | None = None, block_s: float | None = None):
        self.ctx = zmq.Context()
        self.signer = Signer(secrets.token_bytes(32))
        self.io = IOThread(name="test-io")
        self.transport = Transport(self.ctx, self.signer)
        if queue_limit is not None:
            self.transport.queue_limit = queue_limit
        if block_s is not None:
            self.transport.block_s = block_s
        self.transport.use_io(self.io)
        self.dir = tmp_path
        self.inboxes: list[Inbox] = []

    def inbox(self, name: str = "in") -> Inbox:
        inbox = Inbox(self.ctx, f"ipc://{self.dir}/{name}")
        self.inboxes.append(inbox)
        return inbox

    def send(self, addr: str, n: int, body: bytes = b"", block: bool = True) -> None:
        h = Header(Kind.CALL, n, "ipc://x", "ipc://x", "m", "a", "echo", [0])
        h.parts = [[-1, 0, 0]]
        self.transport.send(addr, h, [pickle.dumps((n, body))], block=block)

    def received(self, inbox: Inbox, count: int, deadline_s: float = 30.0) -> list:
        got = []
        deadline = time.monotonic() + deadline_s
        while len(got) < count and time.monotonic() < deadline:
            frames = inbox.recv_within(100)
            if frames is not None:
                _h, body = self.signer.open(frames)
                got.append(pickle.loads(body[0]))
        return got

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.close()
        self.io.loop.call_soon_threadsafe(self.io.loop.stop)
        self.io.thread.join(10)
        self.io.loop.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def wire(tmp_path):
    w = Wire(tmp_path)
    yield w
    w.close()


def test_an_ipc_inbox_takes_datagrams_and_a_message_goes_in_one(wire):
    inbox = wire.inbox()
    assert inbox.dg is not None and os.path.exists(path_of(inbox.address))
    wire.send(inbox.address, 1)
    frames = inbox.dg.receive()  # in the socket's queue once the send returned: no I/O thread
    assert frames is not None and len(frames) == 1
    assert pickle.loads(wire.signer.open(frames)[1][0])[0] == 1


def test_a_message_too_large_for_one_datagram_arrives_whole_and_in_order(wire):
    inbox = wire.inbox()
    big = os.urandom(3 * DGRAM_MAX + 17)  # in pieces
    sizes = [0, len(big), 10, DGRAM_MAX - 100, 0]
    for i, n in enumerate(sizes):
        wire.send(inbox.address, i, big[:n])
    got = wire.received(inbox, len(sizes))
    assert [g[0] for g in got] == list(range(len(sizes)))
    assert [g[1] for g in got] == [big[:n] for n in sizes]


def test_a_burst_beyond_the_peers_queue_waits_in_the_link_and_arrives_in_order(wire):
    inbox = wire.inbox()
    n = 600  # the kernel queues a few datagrams (net.unix.max_dgram_qlen); the link the rest
    t0 = time.monotonic()
    for i in range(n):
        wire.send(inbox.address, i, b"x" * 100)
    assert time.monotonic() - t0 < 20  # nobody read meanwhile, and no send waited for room
    got = wire.received(inbox, n)
    assert [g[0] for g in got] == list(range(n))


def test_a_full_link_fails_the_sender_loudly_after_waiting(tmp_path):
    w = Wire(tmp_path, queue_limit=20, block_s=0.3)
    try:
        inbox = w.inbox()
        with pytest.raises(SendFailed, match="not reading"):
            for i in range(500):  # nobody reads
                w.send(inbox.address, i)
        got = w.received(inbox, 10_000, deadline_s=2.0)
        assert [g[0] for g in got] == list(range(len(got)))  # what was queued came, in order
        assert len(got) >= 20
    finally:
        w.close()


def test_several_threads_keep_each_their_own_order(wire):
    inbox = wire.inbox()

    def sender(k: int) -> None:
        for i in range(200):
            wire.send(inbox.address, k * 1000 + i, b"y" * (DGRAM_MAX if i % 50 == 7 else 10))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    got = wire.received(inbox, 600)
    for t in threads:
        t.join(30)
    for k in range(3):
        mine = [g[0] for g in got if g[0] // 1000 == k]
        assert mine == [k * 1000 + i for i in range(200)]


def test_messages_to_an_inbox_not_there_yet_wait_in_the_link_and_arrive_in_order(wire):
    addr = f"ipc://{wire.dir}/later"
    wire.send(addr, 1)  # nothing listens yet (an actor its rank has not made)
    wire.send(addr, 2)
    inbox = Inbox(wire.ctx, addr)
    wire.inboxes.append(inbox)
    wire.send(addr, 3)
    assert [g[0] for g in wire.received(inbox, 3)] == [1, 2, 3]
    link = wire.transport.links._links()[addr]
    assert link.sock is not None and not link.zmq  # the IO thread connected it: datagrams from now on


def test_once_a_peer_is_gone_its_messages_go_through_zeromq(wire):
    addr = f"ipc://{wire.dir}/gone"
    first = Inbox(wire.ctx, addr)
    wire.send(addr, 1)
    assert [g[0] for g in wire.received(first, 1)] == [1]
    first.close()
    sent = wire.transport.sent
    wire.send(addr, 2)  # the datagram socket refuses: ZeroMQ queues it, as for any peer that is gone
    wire.send(addr, 3)
    assert wire.transport.links._links()[addr].zmq and wire.transport.sent == sent + 2


def test_bad_datagrams_are_dropped_before_anything_is_unpickled(wire, tmp_path):
    inbox = wire.inbox()
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = pickle.dumps(Boom())
    other = Signer(secrets.token_bytes(32))
    h = Header(Kind.CALL, 1, "ipc://x", "ipc://x", "m", "a", "echo", [0])
    h.parts = [[-1, 0, 0]]
    forged = other.seal(h, [evil])[0]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.connect(path_of(inbox.address))
        for junk in (b"\x00" + bytes(forged), b"\x01" + evil, b"\x02" + b"12345678" + evil,
                     b"\x03" + b"\xff" * 8 + evil, b"\x09garbage", b"\x00"):
            s.send(junk)
    finally:
        s.close()
    wire.send(inbox.address, 7)
    dropped = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frames = inbox.recv_within(100)
        if frames is None:
            continue
        try:
            _h, body = wire.signer.open(frames)
        except Dropped:
            dropped += 1
            continue
        assert pickle.loads(body[0])[0] == 7
        break
    assert dropped >= 4  # each whole bad datagram; a lone piece waits for its last one
    assert not marker.exists()


def test_datagrams_off_leaves_ipc_to_zeromq(tmp_path):
    config.set("datagrams", False)
    try:
        w = Wire(tmp_path)
        try:
            inbox = w.inbox()
            assert inbox.dg is None and w.transport.links is None
            w.send(inbox.address, 1)
            assert [g[0] for g in w.received(inbox, 1)] == [1]
        finally:
            w.close()
    finally:
        config.set("datagrams", None)


def test_a_link_waiting_for_a_peer_that_is_gone_stops_trying(wire):
    addr = f"ipc://{wire.dir}/never"
    links = []

    def sender() -> None:  # a thread that sends, then ends without dropping its link
        wire.send(addr, 1)  # waits: nothing listens there yet
        links.append(wire.transport.links._links()[addr])

    t = threading.Thread(target=sender)
    t.start()
    t.join(30)
    link = links[0]
    assert link.pending and not link.zmq
    wire.transport.forget(addr)  # the runtime learnt the peer is gone
    deadline = time.monotonic() + 30
    while not link.zmq and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.zmq and not link.pending  # the IO thread's next try saw it, and stopped


def test_a_peer_back_at_its_old_address_gets_what_waited_for_it(wire):
    addr = f"ipc://{wire.dir}/again"
    wire.transport.forget(addr)  # a rank died there, and is restarted in place (same address)
    done = []

    def sender() -> None:  # a thread's first message there, before the new inbox exists
        wire.send(addr, 1)
        done.append(True)

    t = threading.Thread(target=sender)
    t.start()
    t.join(30)
    time.sleep(0.05)  # the IO thread tries to connect meanwhile, many times
    inbox = Inbox(wire.ctx, addr)
    wire.inboxes.append(inbox)
    assert done and [g[0] for g in wire.received(inbox, 1)] == [1]  # the old death did not drop it
