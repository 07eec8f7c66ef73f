"""Supervision: a child mesh's failure reaches its parent's ``__supervise__``, or the
controller's hook when no one handles it; a rank that dies with no call in flight still
reports; an actor mesh's failures go to the actor that spawned it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.actors import Echo, Fragile, Parent, UnsupervisedParent, wait_for, wait_gone

import monarch_kernel
from monarch_kernel import Actor, endpoint, this_host


@pytest.fixture
def faults():
    seen: list = []
    saved = monarch_kernel.unhandled_fault_hook
    monarch_kernel.unhandled_fault_hook = seen.append
    try:
        yield seen
    finally:
        monarch_kernel.unhandled_fault_hook = saved


@pytest.mark.timeout(60)
def test_supervise_handles_child_mesh_failure(faults):
    with this_host().spawn_procs(per_host={"p": 1}, name="parents") as procs:
        parent = procs.spawn("parent", Parent, "handle")
        child_pids = parent.start_children.call_one(2).get(timeout=40)
        assert len(child_pids) == 2
        killed = parent.kill_child.call_one(1).get(timeout=30)
        assert killed == child_pids[1]
        seen = wait_for(lambda: parent.seen_now.call_one().get(timeout=30), 30)
        assert len(seen) == 1, seen
        # Named as Monarch names it: the failed actor by its mesh path, then why and where.
        assert seen[0].startswith("The actor <root>.<support.actors.Parent parent{'p': 0/1}>."
                                  "<support.actors.Echo kids{'g': 1/2}> "
                                  "and all its descendants have failed:\n  the process this actor was running on "
                                  f"failed: Killed(sig=9) (SIGKILL; rank 1 of mesh 'child', pid {killed} on "), seen[0]
        parent.stop_children.call_one().get(timeout=30)
        # Handled: nothing reached the controller's hook.
        assert parent.seen_now.call_one().get(timeout=30) == seen
        assert [f for f in faults if f.mesh == "child"] == []
    assert wait_gone(child_pids, 10) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handle", ["no handler", "decline", "raise"])
def test_unhandled_child_failure_reaches_controller_hook(faults, handle):
    cls = UnsupervisedParent if handle == "no handler" else Parent
    with this_host().spawn_procs(per_host={"p": 1}, name="parents") as procs:
        parent = procs.spawn("parent", cls, handle)
        child_pids = parent.start_children.call_one(2).get(timeout=40)
        killed = parent.kill_child.call_one(1).get(timeout=30)
        got = wait_for(lambda: [f for f in list(faults) if f.mesh == "child"], 30)
        assert len(got) == 1, got
        f = got[0]
        text = f.report()
        assert f.rank == 1 and f.death is not None and f.death.signal == 9
        assert text.startswith(f"The actor <root>.<support.actors.{cls.__qualname__} parent{{'p': 0/1}}>."
                               "<support.actors.Echo "
                               "kids{'g': 1/2}> and all its descendants have failed:\n  the process this actor was "
                               f"running on failed: Killed(sig=9) (SIGKILL; rank 1 of mesh 'child', "
                               f"pid {killed} on "), text
        assert f"(not handled by <root>.<support.actors.{cls.__qualname__} parent{{'p': 0/1}}>)" in text
        if handle == "raise":
            assert "__supervise__ raised RuntimeError('supervisor broke')" in text
        expected_seen = 0 if handle == "no handler" else 1
        assert len(parent.seen_now.call_one().get(timeout=30)) == expected_seen
        parent.stop_children.call_one().get(timeout=30)
    assert wait_gone(child_pids, 10) == []


@pytest.mark.timeout(60)
def test_rank_death_with_no_call_in_flight_reaches_hook(faults):
    with this_host().spawn_procs(per_host={"gpus": 2}, name="lonely") as procs:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        os.kill(pids[1], signal.SIGKILL)
        got = wait_for(lambda: [f for f in list(faults) if f.mesh == "lonely"], 30)
        assert len(got) == 1
        assert got[0].report().startswith("The actor <root>.<support.actors.Echo echo{'gpus': 1/2}> and all its "
                                          "descendants "
                                          "have failed:\n  the process this actor was running on failed: Killed(sig=9) "
                                          f"(SIGKILL; rank 1 of mesh 'lonely', pid {pids[1]} on "), got[0].report()
        assert m.slice(gpus=0).echo.call_one(1).get(timeout=20) == 1
    # Stopping the mesh is not a failure.
    assert [f for f in faults if f.mesh == "lonely"] == got


class Owner(Actor):
    """Spawns a Fragile mesh of its own on the procs it is given, and keeps what its
    ``__supervise__`` is offered."""

    def __init__(self):
        self.seen: list[str] = []

    def __supervise__(self, failure) -> bool:
        self.seen.append(failure.report())
        return True

    @endpoint
    def start(self, procs) -> None:
        self.fragile = procs.spawn("fragile", Fragile)

    @endpoint
    def break_it(self) -> None:
        self.fragile.poke.broadcast(True)

    @endpoint
    async def seen_so_far(self) -> list[str]:
        return list(self.seen)


@pytest.mark.timeout(90)
def test_failures_of_an_actor_mesh_go_to_the_actor_that_spawned_it():
    with this_host().spawn_procs(per_host={"r": 1}, name="owners") as owners_procs, \
            this_host().spawn_procs(per_host={"r": 2}, name="workers") as worker_procs:
        # The controller spawned the worker procs; the Owner actor spawns the actor mesh.
        owner = owners_procs.spawn("owner", Owner)
        owner.start.call_one(worker_procs).get(timeout=30)
        owner.break_it.call_one().get(timeout=30)
        deadline = time.monotonic() + 20
        while not (seen := owner.seen_so_far.call_one().get(timeout=10)):
            assert time.monotonic() < deadline, "timed out after 20 s waiting for Owner.__supervise__"
            time.sleep(0.1)
        assert "poked to death" in seen[0]
