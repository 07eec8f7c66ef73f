"""The launcher alone, with its rank events and host links, over the fake network and fake
hosts' agents (no processes, no sockets): a mesh spread over two hosts comes up, a killed rank
dies on purpose and restarts in place, a host that goes away takes its ranks with it saying
so, and a stop reaches the ranks that are up."""

from __future__ import annotations

import signal

import pytest
from support.fake_hosts import FakeAgent, Hosting

from monarch_kernel.runtime.spawn import host_messages as hw
from monarch_kernel.runtime.wire.envelope import Kind

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def hosting():
    with Hosting() as h:
        yield h


def spawn_on_two_hosts(h: Hosting):
    a, b = FakeAgent(h, "hostA", "10.0.0.1"), FakeAgent(h, "hostB", "10.0.0.2")
    om = h.launcher.spawn("m", (("x", 4),), hosts=[a.link, b.link])
    assert om.ready.wait(10), "timed out after 10 s waiting for 4 ranks to say hello"
    return om, a, b


def test_a_mesh_spread_over_two_hosts_comes_up_with_their_ports(hosting):
    om, a, b = spawn_on_two_hosts(hosting)
    assert om.ref.addresses == ("tcp://10.0.0.1:7000", "tcp://10.0.0.1:7001",
                                "tcp://10.0.0.2:7000", "tcp://10.0.0.2:7001")
    assert om.ref.hosts == ("hostA", "hostA", "hostB", "hostB") and om.up == {0, 1, 2, 3}
    assert sorted(cfg.rank for cfg in a.forked.values()) == [0, 1] and len(b.forked) == 2
    assert all(cfg.address == om.ref.addresses[cfg.rank] for cfg in [*a.forked.values(), *b.forked.values()])


def test_a_killed_rank_dies_on_purpose_and_restarts_in_place(hosting):
    om, a, b = spawn_on_two_hosts(hosting)
    p = hosting.parts
    (killed,) = hosting.launcher.kill(om, [2])
    assert killed.wait(10), "timed out after 10 s waiting for rank 2's death to be handled"
    assert 2 not in om.alive and p.caller.dead.keys() == {(om.ref.id, 2)}
    assert p.unhandled == []  # ProcMesh.kill is no supervision event
    assert "signal" in p.caller.dead[(om.ref.id, 2)].describe().lower()

    old = set(b.forked)
    (back,) = hosting.launcher.restart(om, [2])
    assert back.wait(10), "timed out after 10 s waiting for rank 2 to come back"
    (new,) = set(b.forked) - old
    assert b.forked[new].rank == 2 and b.forked[new].address == "tcp://10.0.0.2:7000"
    assert om.pids[2] == new and 2 in om.alive and 2 in om.up
    assert p.caller.dead == {}  # its death is forgotten, and the others were told so
    assert {s.header.payload.rank for s in p.transport.take(Kind.REVIVE)} == {2}


def test_a_host_that_goes_away_takes_its_ranks_saying_which_host(hosting):
    om, a, b = spawn_on_two_hosts(hosting)
    p = hosting.parts
    hosting.host_links.forget_host(a.link, "its ssh exited")
    p.io.until(lambda: len(p.unhandled) == 2, what="two supervision events")
    assert om.alive == {2, 3} and a.link.id not in hosting.host_links.links
    assert sorted(f.rank for f in p.unhandled) == [0, 1]
    assert "(its host hostA is gone: its ssh exited)" in p.caller.dead[(om.ref.id, 0)].describe()
    assert p.caller.dead[(om.ref.id, 1)].signal == signal.SIGKILL


def test_a_stop_reaches_the_ranks_that_are_up_and_the_mesh_is_then_forgotten(hosting):
    om, a, b = spawn_on_two_hosts(hosting)
    p = hosting.parts
    done = hosting.launcher.stop(om)
    p.io.until(lambda: any(s.kind == Kind.STOP for s in p.transport.sent), what="the STOP")
    stops = p.transport.take(Kind.STOP)
    assert sorted(r for s in stops for r in s.header.ranks) == [0, 1, 2, 3]
    for agent in (a, b):  # each rank exits as told
        for pid in list(agent.forked):
            agent.tell(hw.Exit(pid, 0))
    assert done.wait(10), "timed out after 10 s waiting for the stopped mesh's ranks to exit"
    assert om.ref.id not in p.meshes and p.unhandled == []
