"""Same-host datagram links (runtime/net/datagram.py): order, pieces, a full peer queue, an inbox
that is not there yet, and bad datagrams, between the runtime's own inboxes and transport
in this process (real sockets, real signing); and the bounds on unfinished messages
(runtime/net/unfinished.py), from a process that speaks the raw format to a real rank."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest
import zmq
from support.actors import wait_for
from support.config import configured

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.runtime.errors import SendFailed
from monarch_kernel.runtime.net import unfinished
from monarch_kernel.runtime.net.datagram import DGRAM_MAX, path_of
from monarch_kernel.runtime.net.inbox import Inbox, actor_address
from monarch_kernel.runtime.net.io_thread import IOThread
from monarch_kernel.runtime.net.transport import Transport
from monarch_kernel.runtime.process import Runtime
from monarch_kernel.runtime.wire import rejects
from monarch_kernel.runtime.wire.auth import Dropped, Signer
from monarch_kernel.runtime.wire.envelope import Header
from monarch_kernel.runtime.wire.kinds import Kind

pytestmark = pytest.mark.timeout(60)


class Wire:
    """A transport and inboxes of this process, as a runtime composes them."""

    def __init__(self, tmp_path, queue_limit: int | None = None, block_s: float | None = None):
        self.ctx = zmq.Context()
        self.key = secrets.token_bytes(32)
        self.signer = Signer(self.key)
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
        inbox = Inbox(self.ctx, f"ipc://{self.dir}/{name}", vouched=self.signer.vouched)
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


def test_what_is_sent_to_a_moved_peers_old_address_reaches_it_where_it_is_now(wire):
    """``Transport.forward``: a rank restarted on another host is reached at its new address
    by whoever sends to the old one (references made before the move name it); a peer that
    moves again, or back, is followed; the table stays empty (nothing looked up) until then."""
    a, b, c = wire.inbox("a"), wire.inbox("b"), wire.inbox("c")
    t = wire.transport
    assert t.forwards() == {}
    wire.send(a.address, 1)
    assert wire.received(a, 1) == [(1, b"")]
    t.forward(a.address, b.address)
    wire.send(a.address, 2)
    assert wire.received(b, 1) == [(2, b"")]
    t.forward(b.address, c.address)  # it moved again: both earlier addresses reach it
    assert t.forwards() == {a.address: c.address, b.address: c.address}
    wire.send(a.address, 3)
    wire.send(b.address, 4)
    assert wire.received(c, 2) == [(3, b""), (4, b"")]
    t.forward(c.address, a.address)  # and back where it began
    assert t.forwards() == {b.address: a.address, c.address: a.address}
    wire.send(a.address, 5)
    wire.send(c.address, 6)
    assert wire.received(a, 2) == [(5, b""), (6, b"")]
    assert wire.received(b, 1, 0.3) == [] and wire.received(c, 1, 0.3) == []


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
    inbox = Inbox(wire.ctx, addr, vouched=wire.signer.vouched)
    wire.inboxes.append(inbox)
    wire.send(addr, 3)
    assert [g[0] for g in wire.received(inbox, 3)] == [1, 2, 3]
    link = wire.transport.links._links()[addr]
    assert link.sock is not None and not link.zmq  # the IO thread connected it: datagrams from now on


def test_once_a_peer_is_gone_its_messages_go_through_zeromq(wire):
    addr = f"ipc://{wire.dir}/gone"
    first = Inbox(wire.ctx, addr, vouched=wire.signer.vouched)
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
    with configured(datagrams=False):
        w = Wire(tmp_path)
        try:
            inbox = w.inbox()
            assert inbox.dg is None and w.transport.links is None
            w.send(inbox.address, 1)
            assert [g[0] for g in w.received(inbox, 1)] == [1]
        finally:
            w.close()


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
    inbox = Inbox(wire.ctx, addr, vouched=wire.signer.vouched)
    wire.inboxes.append(inbox)
    assert done and [g[0] for g in wire.received(inbox, 1)] == [1]  # the old death did not drop it


# ---------------------------------------------------------------- unfinished messages (unfinished.py)
#
# The raw format, written out here so the tests pin it: a datagram's first byte is its tag; a
# message too large for one datagram goes as FIRST (link id, its length, the vouch of those
# three, data), PIECE (link id, data)..., LAST (link id, data), each at most DGRAM_MAX + 1
# bytes.  The vouch: the first 16 bytes of HMAC-SHA256, with the job key, of a fixed label and
# the head (tag, link id, length).  A first piece without it begins nothing.

WHOLE, PACKED, PIECE, LAST, FIRST = 0, 1, 2, 3, 4
STEP = DGRAM_MAX - 8  # data in a piece after the first
FIRST_DATA = STEP - 8 - 16  # data in a first piece
VOUCH_LABEL = b"monarch-kernel/datagram first piece\0"
MIB = 1 << 20
ENVELOPE = MIB  # what a message may hold beyond MONARCH_KERNEL_MAX_FRAME (its header, the MAC)


def packed(frames: list) -> bytes:
    return (struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(bytes(f))) for f in frames)
            + b"".join(bytes(f) for f in frames))


def head_of(link: bytes, total: int, key: bytes | None) -> bytes:
    """A first piece's head and its vouch: with ``key``, or a made-up one without."""
    head = bytes([FIRST]) + link + struct.pack("<Q", total)
    return head + (hmac.new(key, VOUCH_LABEL + head, hashlib.sha256).digest()[:16] if key else os.urandom(16))


def in_pieces(data: bytes, link: bytes, key: bytes | None) -> list[bytes]:
    out = [head_of(link, len(data), key) + data[:FIRST_DATA]]
    out += [bytes([PIECE]) + link + data[i:i + STEP] for i in range(FIRST_DATA, len(data), STEP)]
    out[-1] = bytes([LAST]) + out[-1][1:]
    return out


def first_piece(key: bytes | None, link: bytes, total: int, size: int = FIRST_DATA) -> bytes:
    return head_of(link, total, key) + os.urandom(size)


def next_piece(link: bytes, size: int = STEP, tag: int = PIECE) -> bytes:
    return bytes([tag]) + link + os.urandom(size)


def counts() -> dict:
    return {r: rejects.REJECTS.get("datagram", r) for r in ("oversized", "malformed", "orphan", "stale",
                                                            "too_many", "too_much", "forged")}


def grew(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture
def small(tmp_path):
    """A wire whose inboxes take messages of at most 1 MiB (and its envelope) in pieces,
    age unfinished ones after 0.3 s, and a raw datagram socket onto its inbox."""
    with small_wire(tmp_path, 0.3) as got:
        yield got


@contextlib.contextmanager
def small_wire(tmp_path, timeout: float):
    """The same, with unfinished messages aged after ``timeout`` seconds."""
    with configured(max_frame=MIB, unfinished_timeout=timeout, unfinished_memory=2 * (MIB + ENVELOPE)):
        w = Wire(tmp_path)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        try:
            inbox = w.inbox()
            raw.connect(path_of(inbox.address))
            yield w, inbox, raw
        finally:
            raw.close()
            w.close()


def signed(signer: Signer, n: int, body: bytes, mesh: str = "m") -> list:
    h = Header(Kind.CALL, n, "ipc://x", "ipc://x", mesh, "a", "echo", [0])
    h.parts = [[-1, 0, 0]]
    return signer.seal(h, [pickle.dumps((n, body))])


class Reader:
    """Reads an inbox on a thread of its own, as the runtime does: keeps each authentic
    message, counts the rest, and the most this process held in unfinished messages."""

    def __init__(self, w: Wire, inbox: Inbox):
        self.w, self.inbox = w, inbox
        self.got: list = []
        self.dropped = 0
        self.most = {"messages": 0, "bytes": 0}
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            frames = self.inbox.recv_within(20)
            now = unfinished.held()
            self.most = {k: max(self.most[k], now[k]) for k in now}
            if frames is None:
                continue
            try:
                _h, body = self.w.signer.open(frames)
            except Dropped:
                self.dropped += 1
                continue
            self.got.append(pickle.loads(body[0]))

    def wait(self, n: int, timeout: float = 30) -> list:
        assert wait_for(lambda: len(self.got) >= n, timeout), f"timed out after {timeout} s waiting for {n} " \
                                                             f"messages; {len(self.got)} came"
        return self.got

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.mark.timeout(60)
def test_a_message_announced_over_the_limit_is_refused_at_its_first_piece(small):
    w, inbox, raw = small
    reader = Reader(w, inbox)
    try:
        before = counts()
        exact = os.urandom(MIB)  # a body frame of exactly MONARCH_KERNEL_MAX_FRAME: still passes
        w.send(inbox.address, 1, exact)
        link = os.urandom(8)
        raw.send(first_piece(w.key, link, MIB + ENVELOPE + 1))  # one byte more than a message may be
        for _ in range(12):  # the rest of it: dropped with it, unread and uncounted
            raw.send(next_piece(link))
        raw.send(next_piece(link, tag=LAST))
        w.send(inbox.address, 2, b"after")
        got = reader.wait(2)
        assert [g[0] for g in got] == [1, 2] and got[0][1] == exact and got[1][1] == b"after"
        assert grew(counts(), before) == {"oversized": 1}
        assert reader.most["bytes"] <= 2 * (MIB + ENVELOPE) and not inbox.dg.unfinished
    finally:
        reader.close()


@pytest.mark.timeout(90)
def test_unfinished_messages_are_bounded_in_count_and_bytes_and_legitimate_ones_still_arrive_in_order(small):
    """What a process with the job key, gone wrong, can make a listener hold."""
    w, inbox, raw = small
    reader = Reader(w, inbox)
    budget = 2 * (MIB + ENVELOPE)
    try:
        before = counts()
        bodies = [os.urandom(600_000 + i) for i in range(31)]  # each in 4 pieces
        sent = 0
        # 300 messages begun from as many links, never finished: past 256 the least recently fed go.
        for k in range(300):
            raw.send(first_piece(w.key, os.urandom(8), 2 * MIB, size=1000))
            if k % 30 == 0:
                w.send(inbox.address, sent, bodies[sent])
                sent += 1
        # 20 links that each send 1.8 MB of a 2 MiB message, and stop: the bytes held stay
        # under twice the largest message.
        for _ in range(20):
            link = os.urandom(8)
            raw.send(first_piece(w.key, link, 2 * MIB))
            for _ in range(8):
                raw.send(next_piece(link))
            w.send(inbox.address, sent, bodies[sent])
            sent += 1
        # Pieces of no message begun, and datagrams longer than any piece.
        for _ in range(20):
            raw.send(next_piece(os.urandom(8)))
        for _ in range(5):
            raw.send(b"\x02" + os.urandom(8) + os.urandom(DGRAM_MAX + 100))
        w.send(inbox.address, sent, bodies[sent])
        sent += 1
        got = reader.wait(sent)
        assert [g[0] for g in got] == list(range(sent))
        assert all(g[1] == bodies[g[0]] for g in got)
        assert reader.dropped == 0
        assert reader.most["messages"] <= unfinished.MAX_MESSAGES and reader.most["bytes"] <= budget, reader.most
        assert unfinished.held()["bytes"] <= budget and len(inbox.dg.unfinished) <= unfinished.MAX_MESSAGES
        c = grew(counts(), before)
        assert c.get("too_many", 0) >= 300 - unfinished.MAX_MESSAGES and c.get("too_much", 0) >= 10, c
        assert c.get("orphan") == 20 and c.get("oversized") == 5, c
    finally:
        reader.close()


@pytest.mark.timeout(60)
def test_a_message_whose_sender_stopped_goes_after_the_timeout_and_a_slow_sender_or_reader_is_not_cut(small):
    w, inbox, raw = small
    reader = Reader(w, inbox)
    try:
        before = counts()
        stopped = os.urandom(8)
        raw.send(first_piece(w.key, stopped, 2 * MIB))
        raw.send(next_piece(stopped))
        # A slow sender: a signed message whose pieces come 0.2 s apart (the timeout is 0.3 s),
        # while other messages keep the reader reading to the end between them.
        slow = os.urandom(900_000)
        pieces = in_pieces(packed(signed(w.signer, 100, slow)), os.urandom(8), w.key)
        for i, p in enumerate(pieces):
            raw.send(p)
            w.send(inbox.address, i, b"tick")
            time.sleep(0.2)
        got = reader.wait(len(pieces) + 1)
        assert [g for g in got if g[0] == 100] == [(100, slow)]
        # The stopped sender's message is dropped once the reader has read to the end twice,
        # 0.3 s apart, since its last piece.
        assert wait_for(lambda: not inbox.dg.unfinished, 10), "the stopped sender's pieces are still held"
        assert grew(counts(), before) == {"stale": 1}

        # A slow reader: half of a message read, then the reader away for 1 s while the
        # other half waits in its queue; it arrives whole.
        late = os.urandom(900_000)
        pieces = in_pieces(packed(signed(w.signer, 200, late)), os.urandom(8), w.key)
        for p in pieces[:3]:
            raw.send(p)
        assert wait_for(lambda: len(inbox.dg.unfinished) == 1, 10)
        time.sleep(0.1)  # (the reader reads to the end meanwhile: the age's count starts)
        reader.paused.set()
        time.sleep(0.1)
        for p in pieces[3:]:
            raw.send(p)
        time.sleep(1.0)
        reader.paused.clear()
        assert wait_for(lambda: any(g[0] == 200 for g in reader.got), 10), "the message that waited never came"
        assert [g for g in reader.got if g[0] == 200] == [(200, late)]
        assert grew(counts(), before) == {"stale": 1}
    finally:
        reader.close()


@pytest.mark.timeout(90)
def test_a_sender_without_the_job_key_begins_no_message_and_holds_nothing(small):
    """A process of the same user without the key (or with another job's): first pieces with
    no valid vouch are counted as forged and begin nothing; the pieces after them are orphans.
    The listener holds none of it while messages of the job arrive whole and in order."""
    w, inbox, raw = small
    reader = Reader(w, inbox)
    try:
        before = counts()
        bodies = [os.urandom(600_000 + i) for i in range(10)]  # each in 4 pieces
        stranger = secrets.token_bytes(32)  # another job's key: not in this one's keyring
        sent = 0
        for k in range(300):  # lone first pieces, more than a listener would keep
            raw.send(first_piece(None if k % 2 else stranger, os.urandom(8), 2 * MIB, size=1000))
            if k % 60 == 0:
                w.send(inbox.address, sent, bodies[sent])
                sent += 1
        for _ in range(5):  # messages of 1.8 MB of 2 MiB each, begun, never finished
            link = os.urandom(8)
            raw.send(first_piece(None, link, 2 * MIB))
            for _ in range(8):
                raw.send(next_piece(link))
            w.send(inbox.address, sent, bodies[sent])
            sent += 1
        got = reader.wait(sent)
        assert [g[0] for g in got] == list(range(sent)) and all(g[1] == bodies[g[0]] for g in got)
        assert reader.dropped == 0
        # Only the job's own messages, one at a time, were ever held.
        assert reader.most["messages"] <= 1 and reader.most["bytes"] <= 700_000, reader.most
        assert wait_for(lambda: grew(counts(), before) == {"forged": 300 + 5, "orphan": 5 * 8}, 10), \
            grew(counts(), before)
        assert not inbox.dg.unfinished
    finally:
        reader.close()


@pytest.mark.timeout(90)
def test_a_stalled_sender_of_the_job_keeps_its_message_through_a_flood_without_the_key(tmp_path):
    """A sender of the job that stops between two pieces of a message (a thread held, a process
    stopped) while a process without the key floods the inbox with more first pieces and bytes
    than a listener keeps: nothing of the flood is held, so nothing evicts the stalled message,
    which arrives whole once its sender goes on."""
    with small_wire(tmp_path, 30) as (w, inbox, raw):
        reader = Reader(w, inbox)
        go_on = threading.Event()
        body = os.urandom(900_000)
        pieces = in_pieces(packed(signed(w.signer, 7, body)), os.urandom(8), w.key)

        def sender():
            out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                out.connect(path_of(inbox.address))
                for p in pieces[:2]:
                    out.send(p)
                go_on.wait(60)
                for p in pieces[2:]:
                    out.send(p)
            finally:
                out.close()

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        try:
            before = counts()
            assert wait_for(lambda: len(inbox.dg.unfinished) == 1, 10), "the first pieces were not held"
            for _ in range(2 * unfinished.MAX_MESSAGES):
                raw.send(first_piece(None, os.urandom(8), 2 * MIB, size=1000))
            for _ in range(10):  # 10 x 1.8 MB: more than the 4 MiB of MONARCH_KERNEL_UNFINISHED_MEMORY
                link = os.urandom(8)
                raw.send(first_piece(None, link, 2 * MIB))
                for _ in range(8):
                    raw.send(next_piece(link))
            flood = {"forged": 2 * unfinished.MAX_MESSAGES + 10, "orphan": 80}
            assert wait_for(lambda: grew(counts(), before) == flood, 20), grew(counts(), before)
            assert len(inbox.dg.unfinished) == 1 and reader.got == []
            go_on.set()
            assert reader.wait(1) == [(7, body)]
            assert grew(counts(), before) == flood and not inbox.dg.unfinished
        finally:
            go_on.set()
            thread.join(10)
            reader.close()


def test_a_message_in_pieces_about_another_jobs_mesh_is_vouched_for_with_that_jobs_key(wire):
    """The controller speaks to a mesh of another job with that job's key (``Signer.add_key``),
    and its ranks answer with theirs: a first piece is vouched for with the key its message is
    signed with, and a listener takes a vouch with its own key or one of its keyring."""
    other_key = secrets.token_bytes(32)
    wire.signer.add_key(["their-mesh"], other_key)
    theirs = Signer(other_key)  # a rank of the other job
    addr = f"ipc://{wire.dir}/theirs"
    their_inbox = Inbox(wire.ctx, addr, vouched=theirs.vouched)
    wire.inboxes.append(their_inbox)
    big = os.urandom(3 * DGRAM_MAX)  # in pieces
    h = Header(Kind.CALL, 1, "ipc://x", "ipc://x", "their-mesh", "a", "echo", [0])
    h.parts = [[-1, 0, 0]]
    before = counts()
    wire.transport.send(addr, h, [pickle.dumps((1, big))])
    frames = None
    deadline = time.monotonic() + 30
    while frames is None and time.monotonic() < deadline:
        frames = their_inbox.recv_within(100)
    assert frames is not None, "the message in pieces never came"
    assert pickle.loads(theirs.open(frames)[1][0]) == (1, big)
    # Their answer, in pieces vouched for with their key, reaches this job's inbox.
    mine = wire.inbox("mine")
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    try:
        out.connect(path_of(mine.address))
        for p in in_pieces(packed(signed(theirs, 2, big, mesh="their-mesh")), os.urandom(8), other_key):
            out.send(p)
    finally:
        out.close()
    frames = None
    deadline = time.monotonic() + 30
    while frames is None and time.monotonic() < deadline:
        frames = mine.recv_within(100)
    assert frames is not None and pickle.loads(wire.signer.open(frames)[1][0]) == (2, big)
    assert grew(counts(), before) == {}


def test_an_inbox_that_closes_lets_go_of_its_unfinished_messages(small):
    """An actor's inbox closes with a message half come: its bytes no longer count against the
    room every other inbox of the process shares."""
    w, inbox, raw = small
    before = unfinished.held()
    raw.send(first_piece(w.key, os.urandom(8), 2 * MIB))

    def held_one() -> bool:
        inbox.dg.receive()
        return unfinished.held()["messages"] == before["messages"] + 1

    assert wait_for(held_one, 10)
    w.inboxes.remove(inbox)
    inbox.close()
    assert unfinished.held() == before


# ---------------------------------------------------------------- the same, on a real rank

RAW_SENDER = r"""
import os, socket, struct, sys
path, step, most = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
s.connect(path)
def first(link, total, size):  # its vouch made up: the sender has no key of the job
    s.send(bytes([4]) + link + struct.pack("<Q", total) + os.urandom(16) + os.urandom(size))
def piece(link, size, tag=2):
    s.send(bytes([tag]) + link + os.urandom(size))
for k in range(40):  # begun, never finished
    link = os.urandom(8)
    first(link, most, step - 8 - 16)
    for _ in range(20):
        piece(link, step)
for k in range(40):  # continued, never begun nor finished (what a sender of the old format left)
    link = os.urandom(8)
    for _ in range(21):
        piece(link, step)
for k in range(300):  # more messages begun than a process keeps
    first(os.urandom(8), most, 100)
first(os.urandom(8), 64 << 30, 100)  # announced far over the limit
for big in (4 << 20, 300_000):  # pieces far larger than any of this wire (the largest this socket sends)
    try:
        for k in range(10):
            piece(os.urandom(8), big)
        break
    except OSError:
        continue
print("sent", flush=True)
"""


class Keeper(Actor):
    def __init__(self):
        self.seen: list[int] = []

    @endpoint
    def take(self, i: int, blob: bytes) -> str:
        self.seen.append(i)
        return hashlib.sha256(blob).hexdigest()

    @endpoint
    def order(self) -> list[int]:
        return self.seen

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def stats(self) -> dict:
        return Runtime.current().stats()


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


@pytest.mark.timeout(180)
def test_a_rank_holds_nothing_a_raw_sender_without_the_key_begins():
    """A process of the same user, without the job key, sends a rank's actor inbox, in the raw
    datagram format, never-finished messages from many links, pieces of nothing, oversized
    pieces and an announcement of 64 GiB, while the controller sends it legitimate messages in
    pieces.  None of its first pieces is vouched for, so the rank begins none of its messages:
    it holds nothing of them and evicts nothing for them; every drop is counted, and the
    legitimate messages arrive whole and in order."""
    max_frame = 8 * MIB
    budget = 2 * (max_frame + ENVELOPE)
    env = {"MONARCH_KERNEL_MAX_FRAME": str(max_frame), "MONARCH_KERNEL_UNFINISHED_TIMEOUT": "1",
           "MONARCH_KERNEL_UNFINISHED_MEMORY": str(budget)}
    with this_host().spawn_procs(per_host={"gpus": 1}, env=env) as procs:
        keeper = procs.spawn("keeper", Keeper)
        pid = keeper.pid.call_one().get(timeout=30)
        blobs = [os.urandom(MIB + i) for i in range(24)]  # each in 6 pieces
        for i in range(4):  # warm: the rank has joined messages of this size before
            assert keeper.take.call_one(-1, blobs[i]).get(timeout=30) == hashlib.sha256(blobs[i]).hexdigest()
        rss_before = psutil.Process(pid).memory_info().rss
        before = keeper.stats.call_one().get(timeout=30)["rejected"]

        path = path_of(actor_address(procs._ref.addresses[0], keeper._actor_id))
        sender = subprocess.Popen([sys.executable, "-c", RAW_SENDER, path, str(STEP), str(max_frame)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            futures = []
            for i, blob in enumerate(blobs):  # interleaved with the raw sender's datagrams
                futures.append(keeper.take.call_one(i, blob))
                time.sleep(0.02)
            out, err = sender.communicate(timeout=120)
            assert sender.returncode == 0 and b"sent" in out, err.decode()
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait(10)
        assert [f.get(timeout=60) for f in futures] == [hashlib.sha256(b).hexdigest() for b in blobs]
        assert keeper.order.call_one().get(timeout=30)[4:] == list(range(len(blobs)))

        def counted():
            """The rank's datagram rejections since ``before``, once the sender's are all in."""
            st = keeper.stats.call_one().get(timeout=30)
            c = {k.split("/")[1]: n - before.get(k, 0) for k, n in st["rejected"].items()
                 if k.startswith("datagram/") and n != before.get(k, 0)}
            return (st, c) if c.get("forged", 0) >= 341 and c.get("orphan", 0) >= 1640 else None

        got = wait_for(counted, timeout=30, interval=0.2)
        assert got, f"the rank did not count the raw sender's datagrams: {keeper.stats.call_one().get(timeout=30)}"
        stats, c = got
        # 40 + 300 + 1 first pieces, forged; the 40 x 20 and 40 x 21 pieces after them, orphans;
        # 10 pieces too long for this wire; nothing begun, so nothing evicted, refused or aged.
        assert c == {"forged": 341, "orphan": 1640, "oversized": 10}, c
        assert stats["unfinished"] == {"messages": 0, "bytes": 0}, stats["unfinished"]
        peak = _peak_rss(pid) - rss_before
        assert peak < 48 * MIB, f"the rank's memory grew by {peak >> 20} MiB"
        assert keeper.take.call_one(99, blobs[0]).get(timeout=30) == hashlib.sha256(blobs[0]).hexdigest()


FLOOD = r"""
import hashlib, hmac, os, socket, struct, sys
path, step = sys.argv[1], int(sys.argv[2])
key = bytes.fromhex(sys.stdin.readline().strip())  # a process of the job, gone wrong: it has the key
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
s.connect(path)
for k in range(40):  # 40 links, each 21 pieces of a message of 16 GiB, never finished
    link = os.urandom(8)
    head = bytes([4]) + link + struct.pack("<Q", 16 << 30)
    vouch = hmac.new(key, b"monarch-kernel/datagram first piece\0" + head, hashlib.sha256).digest()[:16]
    s.send(head + vouch + os.urandom(step - 8 - 16))
    for _ in range(20):
        s.send(bytes([2]) + link + os.urandom(step))
print("sent", flush=True)
"""


@pytest.mark.timeout(120)
def test_unfinished_pieces_are_bounded_by_unfinished_memory_not_by_the_largest_frame():
    """With the default settings (frames of up to 16 GiB), 40 links of a process with the job
    key that each send 21 pieces of a message and stop (about 168 MB) grow a rank by no more
    than MONARCH_KERNEL_UNFINISHED_MEMORY (64 MiB) and its slack; before, the bound was twice
    16 GiB and the rank grew by ~165 MB.  (Only the user's own processes reach a rank's datagram
    socket, its folder being 0700, and only those with the key begin a message there.)"""
    budget = 64 * MIB
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        keeper = procs.spawn("keeper", Keeper)
        pid = keeper.pid.call_one().get(timeout=30)
        blob = os.urandom(3 * MIB)
        assert keeper.take.call_one(-1, blob).get(timeout=30) == hashlib.sha256(blob).hexdigest()
        rss_before = psutil.Process(pid).memory_info().rss
        path = path_of(actor_address(procs._ref.addresses[0], keeper._actor_id))
        out = subprocess.run([sys.executable, "-c", FLOOD, path, str(STEP)], capture_output=True, timeout=60,
                             input=Runtime.current().key.hex().encode() + b"\n")
        assert out.returncode == 0 and b"sent" in out.stdout, out.stderr.decode()
        stats = keeper.stats.call_one().get(timeout=30)
        assert stats["unfinished"]["bytes"] <= budget, stats["unfinished"]
        assert stats["rejected"].get("datagram/too_much", 0) >= 20, stats["rejected"]
        peak = _peak_rss(pid) - rss_before
        assert peak < budget + 40 * MIB, f"the rank's memory grew by {peak >> 20} MiB (the bound is {budget >> 20})"
        # A message larger than the bound alone still arrives whole.
        big = os.urandom(80 * MIB)
        assert keeper.take.call_one(0, big).get(timeout=60) == hashlib.sha256(big).hexdigest()
