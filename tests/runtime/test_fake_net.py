"""The fakes of tests/support/fake_net.py, tested in turn: a test built on them is only as
good as they are (dask tests its ``utils_test`` helpers the same way)."""

from __future__ import annotations

import threading
import time

import pytest
from support.fake_net import KEY, FakeInbox, FakeIO, FakeNetwork, FakeReceiver, FakeTransport, Parts, mesh

from monarch_kernel.runtime.completion import Completion
from monarch_kernel.runtime.errors import SendFailed
from monarch_kernel.runtime.wire.auth import Signer
from monarch_kernel.runtime.wire.envelope import Header, Kind

pytestmark = pytest.mark.timeout(30)


def test_the_transport_keeps_what_the_peer_would_read_not_the_senders_object():
    t = FakeTransport(Signer(KEY))
    h = Header.control(Kind.STOP, "ipc://me", "m", [0, 1])
    h.parts = [[0, 0, 0]]  # one part: the body's one frame
    t.send("ipc://peer", h, [b"x"])
    h.ranks = [7]  # the sender reuses its header object, as the caller does
    (sent,) = t.take()
    assert (sent.address, sent.kind, sent.header.ranks, sent.body) == ("ipc://peer", Kind.STOP, [0, 1], [b"x"])
    assert t.take() == []
    t.down.add("ipc://gone")
    with pytest.raises(SendFailed, match="ipc://gone is down"):
        t.send("ipc://gone", h, [])


def test_take_of_one_kind_leaves_the_others():
    t = FakeTransport(Signer(KEY))
    t.send("a", Header.control(Kind.STOP), [])
    t.send("b", Header.control(Kind.WAKE), [])
    assert [s.address for s in t.take(Kind.WAKE)] == ["b"]
    assert [s.address for s in t.take()] == ["a"]


def test_the_io_runs_queued_work_then_due_timers_as_the_io_thread():
    io = FakeIO()
    seen = []
    io.call_soon(lambda: seen.append(("soon", io.is_current())))
    io.loop.call_later(0.05, lambda: seen.append(("later", io.is_current())))
    assert not io.is_current()
    assert io.turn() == 1 and seen == [("soon", True)]
    io.until(lambda: len(seen) == 2, timeout=5, what="the timer")
    assert seen[1] == ("later", True) and not io.is_current()
    with pytest.raises(AssertionError, match="timed out after 0.1 s waiting for nothing"):
        io.until(lambda: False, timeout=0.1, what="nothing")


def test_inboxes_network_and_receiver_answer_as_the_parts_expect():
    net = FakeNetwork()
    inbox = net.thread_inbox("ipc://me", 3)
    assert inbox.address == "ipc://me.t3" and inbox.owns("ipc://me.t3") and not inbox.ready()
    assert net.answerable(inbox, "ipc://peer") == "ipc://me.t3" and net.reach("x", "y") == "y"
    inbox.queue.append([b"f"])
    assert inbox.ready() and inbox.recv() == [b"f"] and inbox.recv() is None
    net.close()
    assert inbox.closed
    r = FakeReceiver()
    c = Completion()
    threading.Timer(0.05, c.set_result, (True,)).start()
    t0 = time.monotonic()
    assert r.wait(c, 5) and time.monotonic() - t0 < 4
    other = FakeInbox("ipc://o")
    r.watch(other)
    r.unwatch(other)
    assert r.watched == [other] and r.unwatched == [other]
    other.close()


def test_parts_are_the_runtimes_own_wired_alike():
    p = Parts(member_of=(mesh(2), 1))
    try:
        assert p.server.actors is p.lives.actors and p.gathering.my_rank("id-m") == 1
        assert p.caller.reply_inboxes.mine().address == "ipc://ctl.t1"  # a thread's own inbox
        assert p.io.run(p.caller.reply_inboxes.mine) is p.inbox  # the IO thread's: the main inbox
    finally:
        p.close()


def test_a_fake_agent_answers_its_link_as_an_agent_does():
    from support.fake_hosts import FakeAgent, Hosting

    with Hosting() as h:
        agent = FakeAgent(h, "hostA", "10.0.0.1")
        assert agent.link.up.done() and agent.link.ip == "10.0.0.1" and agent.link.address == agent.address
        got = agent.link.reserve_async(3)
        assert got.wait(10) and got.result() == [7000, 7001, 7002]
        h.host_links.end_host(agent.link)
        h.parts.io.until(lambda: agent.byes == 1, what="the agent's Bye")
