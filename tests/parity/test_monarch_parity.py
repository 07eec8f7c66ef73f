"""Where Monarch's behaviour was met only in part: an ``__init__`` that raises reaches the
spawner's hook at once, one event per rank, worded as Monarch's report; one that never
returns holds up only calls to that actor, and its mesh still stops; a child's broadcast
failure reaches its parent's ``__supervise__`` while the parent awaits it; ``stream()`` is
iterated synchronously inside an async endpoint; stopping an actor or its procs stops the
meshes it spawned (their ``__cleanup__`` runs); a rank's own procs start through the
interpreter its spawner named.  One shared mesh of two ranks for most of them."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import sys
import threading

import pytest
from support.actors import wait_for

import monarch_kernel
from monarch_kernel import Actor, ActorError, Channel, MeshFailure, Port, endpoint, this_host

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"r": 2}, name="parity")
    yield pm
    pm.stop().get(timeout=30)


@pytest.fixture
def faults(monkeypatch):
    seen: list[MeshFailure] = []
    monkeypatch.setattr(monarch_kernel, "unhandled_fault_hook", seen.append)
    return seen


class Broken(Actor):
    def __init__(self):
        raise ValueError("no data loader on this rank")

    @endpoint
    def ping(self) -> None: ...


class Counter(Actor):
    def __init__(self, v: int = 0):
        self.v = v

    @endpoint
    def incr(self) -> None:
        self.v += 1

    @endpoint
    def value(self) -> int:
        return self.v


class NeverReady(Actor):
    """``__init__`` spawns a Counter, hands it out through a port, then never returns."""

    def __init__(self, procs, port: Port):
        port.send(procs.spawn("from_init", Counter, 42))
        threading.Event().wait()

    @endpoint
    def ping(self) -> None: ...


class Child(Actor):
    def __init__(self, counter=None):
        self.counter = counter

    @endpoint
    def noop(self) -> None: ...

    @endpoint
    def fail(self) -> None:
        raise RuntimeError("the child gave up")

    @endpoint
    def which(self) -> int:
        from monarch_kernel import current_rank

        return current_rank().rank

    def __cleanup__(self, exc) -> None:
        if self.counter is not None:
            self.counter.incr.call_one().get(timeout=20)


class Parent(Actor):
    """Spawns a Child mesh on the procs it is given; waits for its own ``__supervise__``
    inside an async endpoint, as Monarch's users write it."""

    def __init__(self, procs, counter=None):
        self.child = procs.spawn("child", Child, counter)
        self.failures: list[str] = []
        self.faulted = asyncio.Event()

    def __supervise__(self, failure) -> bool:
        self.failures.append(str(failure))
        self.faulted.set()
        return True

    @endpoint
    async def break_child(self) -> list[str]:
        await self.child.noop.call()
        self.child.fail.broadcast()
        await asyncio.wait_for(self.faulted.wait(), timeout=20)  # before: never set while this ran
        return self.failures

    @endpoint
    async def gather_by_sync_stream(self) -> list[int]:
        return sorted([await fut for fut in self.child.which.stream()])  # before: "would block"

    @endpoint
    def check(self) -> None:
        self.child.noop.call().get(timeout=20)


def test_an_init_that_raises_reaches_the_hook_at_once_once_per_rank(procs, faults):
    procs.spawn("broken", Broken)  # nothing waits on it: supervision must hear anyway
    wait_for(lambda: len(faults) >= 2, timeout=15)
    assert sorted(f.rank for f in faults) == [0, 1]
    report = next(f for f in faults if f.rank == 1).report()
    assert report.startswith("The actor <root>.<test_monarch_parity.Broken broken{'r': 1/2}> and all its "
                             "descendants have failed:\n  Actor call broken.__init__ failed."), report
    assert "ValueError: no data loader on this rank" in report and 'in __init__' in report
    assert str(faults[0]).startswith(f"MeshFailure(mesh_name=parity, crashed_ranks=[{faults[0].rank}], "
                                     "event=The actor <root>.<test_monarch_parity.Broken broken")


class Lambda(Actor):
    @endpoint
    def run(self, func):
        return func()


class Nest(Actor):
    """Monarch's test_supervision_hierarchy.Nest: a nested proc mesh of its own, one rank."""

    def __init__(self):
        self.nest = this_host().spawn_procs(per_host={"a_dim": 1}).spawn("nested", Lambda)

    @endpoint
    def kill_nest(self) -> int:
        pid = self.nest.run.call_one(os.getpid).get(timeout=20)
        os.kill(pid, 9)
        return pid


def test_a_nested_procs_death_names_the_failed_actor_by_its_mesh_path(procs, faults):
    # Monarch's test_proc_failure matches "(nested|logger-.*)\{'a_dim': 0/1\}" and "the process
    # this actor was running on failed: Killed\(sig=9\)".  Before: "rank 0 of mesh 'procs' (pid
    # ...) killed by signal 9 (SIGKILL)\n  (not handled by Nest on rank 0 of mesh 'procs')".
    top = procs.slice(r=0).spawn("top", Nest)
    pid = top.kill_nest.call_one().get(timeout=30)
    wait_for(lambda: faults, timeout=20)
    report = faults[0].report()
    assert re.search(r"(nested|logger-.*)\{'a_dim': 0/1\}", report), report
    assert re.search(r"the process this actor was running on failed: Killed\(sig=9\)", report), report
    nest = "<test_monarch_parity.Nest top{'r': 0/2}>"
    assert report.splitlines()[:3] == [
        f"The actor <root>.{nest}.<test_monarch_parity.Lambda nested{{'a_dim': 0/1}}> and all its descendants "
        "have failed:",
        f"  the process this actor was running on failed: Killed(sig=9) (SIGKILL; rank 0 of mesh '{faults[0].mesh}', "
        f"pid {pid} on {faults[0].death.host})",
        f"  (not handled by <root>.{nest})"], report
    top.stop().get(timeout=20)


def test_actor_error_names_the_mesh_as_the_user_did(procs):
    child = procs.spawn("child", Child)
    with pytest.raises(ActorError) as info:
        child.fail.call().get(timeout=20)
    # Before: "Actor call child-1a2b3c.fail failed." (the runtime's unique id).
    assert str(info.value).startswith("Actor call child.fail failed.\n"), str(info.value)


def test_an_init_that_never_returns_holds_up_only_calls_to_it(procs):
    send, recv = Channel.open()
    stuck = procs.slice(r=0).spawn("stuck", NeverReady, procs.slice(r=0), send)
    counter = recv.recv().get(timeout=20)  # spawned from inside the __init__ that never returns
    assert counter.value.call_one().get(timeout=20) == 42
    with pytest.raises(TimeoutError):
        stuck.ping.call_one().get(timeout=0.3)
    stuck.stop().get(timeout=10)  # before: waited for __init__ forever
    with pytest.raises(ActorError, match="stopped it before its __init__ returned"):
        stuck.ping.call_one().get(timeout=10)


def test_a_childs_broadcast_failure_reaches_the_parent_while_it_awaits(procs, faults):
    parent = procs.slice(r=0).spawn("parent", Parent, procs.slice(r=1))
    failures = parent.break_child.call_one().get(timeout=30)
    assert len(failures) == 1 and "the child gave up" in failures[0]
    assert ("The actor <root>.<test_monarch_parity.Parent parent{'r': 0/2}>.<test_monarch_parity.Child "
            "child{'r': 1/2}> and all its descendants have failed:") in failures[0], failures[0]
    assert faults == []  # handled by the parent


def test_a_stream_iterated_synchronously_inside_an_async_endpoint(procs):
    parent = procs.slice(r=0).spawn("parent", Parent, procs)
    assert parent.gather_by_sync_stream.call_one().get(timeout=30) == [0, 1]


def test_stopping_an_actor_or_its_procs_stops_what_it_spawned(procs):
    counter = procs.slice(r=0).spawn("counter", Counter)
    # ActorMesh.stop() of the parent: its children's __cleanup__ runs (Monarch's recursive stop).
    parent = procs.slice(r=0).spawn("parent", Parent, procs.slice(r=1), counter)
    parent.check.call_one().get(timeout=20)
    parent.stop().get(timeout=20)
    assert wait_for(lambda: counter.value.call_one().get(timeout=10) == 1, timeout=15)
    # ProcMesh.stop() of the procs the parent runs on: the same.
    with this_host().spawn_procs(per_host={"r": 1}, name="parents") as parents:
        parent = parents.spawn("parent", Parent, procs, counter)
        parent.check.call_one().get(timeout=20)
    assert wait_for(lambda: counter.value.call_one().get(timeout=10) == 3, timeout=15)  # one per child rank


class Marker(Actor):
    @endpoint
    def wrapper_pid(self) -> str:
        return os.environ.get("PARITY_WRAPPER_PID", "")

    @endpoint
    def spawn_inner(self):
        return this_host().spawn_procs(per_host={"r": 1}, name="inner").spawn("inner", Marker)


def test_a_ranks_own_procs_start_through_its_spawners_interpreter(tmp_path):
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexport PARITY_WRAPPER_PID=$$\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with this_host().with_python_executable(str(wrapper)).spawn_procs(per_host={"r": 1}) as pm:
        outer = pm.spawn("marker", Marker)
        direct = outer.wrapper_pid.call_one().get(timeout=20)
        inner = outer.spawn_inner.call_one().get(timeout=30).wrapper_pid.call_one().get(timeout=20)
    # Before: the inner rank was forked from the outer rank's interpreter and inherited its pid.
    assert re.fullmatch(r"\d+", direct) and re.fullmatch(r"\d+", inner) and inner != direct
