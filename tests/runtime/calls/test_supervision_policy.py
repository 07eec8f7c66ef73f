"""The supervision policy alone, with the rank events that record deaths (no processes, no
sockets): which deaths become supervision events, what every mesh is told, and the
accounting of a restart: the deaths forgotten, the other meshes told, and a restart that
dies again failing."""

from __future__ import annotations

import pytest
from support.fake_net import Parts, death, mesh

from monarch_kernel.runtime.completion import Completion
from monarch_kernel.runtime.errors import ProcessDied
from monarch_kernel.runtime.spawn.owned_mesh import OwnedMesh
from monarch_kernel.runtime.spawn.rank_events import RankEvents
from monarch_kernel.runtime.wire.envelope import Kind, Status
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(30)


def up(p: Parts, name: str, n: int) -> OwnedMesh:
    """A mesh this process spawned whose ``n`` ranks are all up."""
    om = OwnedMesh(mesh(n, name), None)
    om.alive, om.up = set(range(n)), set(range(n))
    om.ready.set_result(True)
    p.meshes[om.ref.id] = om
    return om


@pytest.fixture
def ctl():
    p = Parts(fanout=8)
    p.events = RankEvents(meshes=p.meshes, supervision=p.supervision, receiver=p.receiver, inbox=p.inbox,
                          drops=p.drops)
    yield p
    p.close()


def test_a_death_nobody_waited_on_is_supervised_and_one_a_call_saw_is_not(ctl):
    om = up(ctl, "m", 3)
    up(ctl, "o", 2)  # another mesh, which hears of deaths too
    ctl.events.died(om, 1, death(om.ref, 1))
    assert [f.rank for f in ctl.unhandled] == [1] and ctl.caller.dead.keys() == {(om.ref.id, 1)}
    told = {(s.address, s.header.payload.mesh) for s in ctl.transport.take(Kind.DEATH)}
    # every live rank of every mesh (fanout 8: each its own subtree), the dead one apart
    assert told == {(a, om.ref.id) for a in ("ipc://m.0", "ipc://m.2", "ipc://o.0", "ipc://o.1")}

    pending = ctl.caller.call(om.ref, "a", "f", [0, 2], dumps(((), {})))
    ctl.events.died(om, 2, death(om.ref, 2))
    assert pending.parts[2].status == Status.DIED
    assert len(ctl.unhandled) == 1  # the caller heard ProcessDied: no supervision event

    om.dying[0] = killed = Completion()  # ProcMesh.kill: on purpose
    ctl.events.died(om, 0, death(om.ref, 0))
    assert killed.done() and len(ctl.unhandled) == 1


def test_a_restart_forgets_the_death_tells_every_mesh_and_fails_if_the_rank_dies_again(ctl):
    om = up(ctl, "m", 3)
    up(ctl, "o", 2)  # another mesh, which hears of deaths too
    ctl.events.died(om, 1, death(om.ref, 1))
    ctl.transport.take()
    assert ctl.caller.dead.keys() == {(om.ref.id, 1)}

    om.restarting[1] = back = Completion()  # what Launcher.restart does before it forks again
    om.alive.add(1)
    om.up.discard(1)
    ctl.supervision.on_revive(om, [1])
    assert ctl.caller.dead == {}
    revived = ctl.transport.take(Kind.REVIVE)
    # the ranks that are up, of every mesh, hear that rank 1 of "m" lives again
    assert {(s.address, s.header.payload.mesh, s.header.payload.rank) for s in revived} == {
        (a, om.ref.id, 1) for a in ("ipc://m.0", "ipc://m.2", "ipc://o.0", "ipc://o.1")}

    ctl.events.died(om, 1, death(om.ref, 1))  # dead again before its hello
    assert isinstance(back.error(), ProcessDied)
    assert ctl.caller.dead.keys() == {(om.ref.id, 1)} and [f.rank for f in ctl.unhandled] == [1, 1]


def test_a_stopped_mesh_is_forgotten_with_its_last_rank_and_its_deaths_are_no_events(ctl):
    om = up(ctl, "m", 2)
    ctl.supervision.note_hosted(om.ref.id, None, "tests.A", "a1", [0, 1])
    om.stopping = True
    for r in (0, 1):
        ctl.events.died(om, r, death(om.ref, r))
    assert om.exited.done() and om.ref.id not in ctl.meshes and ctl.unhandled == []
