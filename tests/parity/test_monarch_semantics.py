"""What an actor *is*, as in Monarch: spawning returns at once and ``__init__`` runs in the
background; a failed ``__init__`` is a supervision event and later calls carry its
traceback; an exception that escapes a ``broadcast`` stops the actor and reaches the actor
mesh's owner (one that escapes a ``tell``, the proc mesh's owner); ``MeshFailure.report()`` is a method.
(That an actor mesh's failures go to the actor that spawned it: test_supervision.py.)"""

from __future__ import annotations

import os
import time

import pytest
from support.actors import Fragile, wait_for

import monarch_kernel
from monarch_kernel import Actor, ActorError, endpoint, this_host

pytestmark = pytest.mark.timeout(90)


class Gated(Actor):
    """``__init__`` waits until a file exists: the test decides when it returns."""

    def __init__(self, gate: str):
        while not os.path.exists(gate):
            time.sleep(0.02)
        self.ready = True

    @endpoint
    def ping(self) -> bool:
        return self.ready


def test_spawn_returns_before_init_and_calls_queue_behind_it(tmp_path):
    gate = tmp_path / "gate"
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        gated = procs.spawn("gated", Gated, str(gate))  # before: blocked until __init__ returned
        pending = gated.ping.call()
        assert not gated.initialized().done() and not pending.done()
        gate.touch()
        assert list(pending.get(timeout=30).values()) == [True, True]
        gated.initialized().get(timeout=10)


def test_an_init_that_never_returns_does_not_hang_the_spawner(tmp_path):
    procs = this_host().spawn_procs(per_host={"r": 1})
    try:
        stuck = procs.spawn("stuck", Gated, str(tmp_path / "never"))
        with pytest.raises(TimeoutError):
            stuck.initialized().get(timeout=0.5)
    finally:
        procs.stop().get(timeout=20)


def test_a_broadcast_exception_stops_the_actor_and_reaches_the_unhandled_hook(monkeypatch):
    events = []
    monkeypatch.setattr(monarch_kernel, "unhandled_fault_hook", events.append)
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        fragile = procs.spawn("fragile", Fragile)
        # An exception returned to a caller leaves the actor alive.
        with pytest.raises(ActorError):
            fragile.slice(r=0).poke.call_one(True).get(timeout=30)
        assert fragile.slice(r=0).poke.call_one(False).get(timeout=30) == 2
        fragile.slice(r=1).poke.broadcast(True)  # nobody receives this one
        wait_for(lambda: events, timeout=20)
        assert len(events) == 1 and "poked to death after 1 calls" in events[0].report()
        with pytest.raises(ActorError, match="poked to death after 1 calls"):
            fragile.slice(r=1).poke.call_one(False).get(timeout=30)  # stopped: says why
        assert fragile.slice(r=0).poke.call_one(False).get(timeout=30) == 3  # rank 0 is fine


def test_tell_runs_on_every_rank_of_the_slice_in_order():
    with this_host().spawn_procs(per_host={"r": 3}) as procs:
        fragile = procs.spawn("fragile", Fragile)
        for _ in range(200):
            fragile.poke.tell(False)
        # Messages to one actor run in order: the tells land before this call.
        assert list(fragile.poke.call(False).get(timeout=30).values()) == [201, 201, 201]
        fragile.slice(r=slice(1, 3)).poke.tell(False)
        assert list(fragile.poke.call(False).get(timeout=30).values()) == [202, 203, 203]


def test_a_told_exception_stops_the_actor_and_reaches_the_unhandled_hook(monkeypatch):
    events = []
    monkeypatch.setattr(monarch_kernel, "unhandled_fault_hook", events.append)
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        fragile = procs.spawn("fragile", Fragile)
        fragile.slice(r=1).poke.tell(True)  # nobody waits for an answer: the rank reports it
        wait_for(lambda: events, timeout=20)
        assert len(events) == 1 and events[0].rank == 1
        report = events[0].report()
        assert "poked to death after 1 calls" in report and "Fragile" in report, report
        with pytest.raises(ActorError, match="poked to death after 1 calls"):
            fragile.slice(r=1).poke.call_one(False).get(timeout=30)  # stopped: says why
        assert fragile.slice(r=0).poke.call_one(False).get(timeout=30) == 1  # rank 0 is fine


def test_mesh_failure_report_is_a_method():
    from monarch_kernel import MeshFailure

    failure = MeshFailure("m", 1, "rank 1 of mesh 'm' broke")
    failure.chain.append("Trainer on rank 0 of mesh 'top'")
    assert failure.report().startswith("rank 1 of mesh 'm' broke")
    assert "(not handled by Trainer on rank 0 of mesh 'top')" in failure.report()
    assert str(failure) == f"MeshFailure(mesh_name=m, crashed_ranks=[1], event={failure.report()})"
    # An actor's failure is worded as Monarch's report, the cause indented under it.
    failure = MeshFailure("m", 1, "Actor call w.step failed.\n It raised", actor="<root>.<W w{'r': 1/2}>")
    assert failure.report() == ("The actor <root>.<W w{'r': 1/2}> and all its descendants have failed:\n"
                                "  Actor call w.step failed.\n   It raised")


class Streamer(Actor):
    """Streams from other actors inside an async endpoint (on the rank's event loop)."""

    @endpoint
    async def gather_by_stream(self, workers) -> list[int]:
        return sorted([await fut async for fut in workers.which.stream()])

    @endpoint
    async def sync_iteration_inside(self, workers) -> list[int]:
        return sorted(fut.get() for fut in workers.which.stream())  # blocks this actor only


class Which(Actor):
    @endpoint
    def which(self) -> int:
        from monarch_kernel import current_rank

        return current_rank().rank


def test_stream_inside_async_code_never_blocks_the_event_loop():
    # Before: iterating a stream inside an async endpoint deadlocked the rank's event loop;
    # then it raised "would block the event loop".  Now it blocks that actor alone, as Monarch's.
    import asyncio

    with this_host().spawn_procs(per_host={"r": 3}) as procs:
        workers = procs.spawn("workers", Which)
        streamer = procs.slice(r=0).spawn("streamer", Streamer)
        assert streamer.gather_by_stream.call_one(workers).get(timeout=30) == [0, 1, 2]
        assert streamer.sync_iteration_inside.call_one(workers).get(timeout=30) == [0, 1, 2]

        async def from_an_async_cell():
            return sorted([await fut async for fut in workers.which.stream()])

        assert asyncio.run(from_an_async_cell()) == [0, 1, 2]
        assert sorted(f.get() for f in workers.which.stream()) == [0, 1, 2]  # the sync iterator too


class Ordered(Actor):
    """Async endpoints that would interleave at every await if run concurrently."""

    def __init__(self):
        import threading

        self.log: list[str] = []
        self.local = threading.local()
        self.local.tag = "set in __init__"
        self.init_thread = threading.get_ident()

    @endpoint
    async def step(self, name: str, pause: float) -> None:
        import asyncio

        self.log.append(f"{name} start")
        await asyncio.sleep(pause)
        self.log.append(f"{name} end")

    @endpoint
    def history(self) -> list[str]:
        return list(self.log)

    @endpoint
    async def thread_state(self) -> tuple:
        import threading

        return getattr(self.local, "tag", None), threading.get_ident() == self.init_thread

    @endpoint(concurrent=True)
    async def side(self, name: str, pause: float) -> str:
        import asyncio

        self.log.append(f"{name} start")
        await asyncio.sleep(pause)
        self.log.append(f"{name} end")
        return name


def test_an_actor_takes_one_message_at_a_time_async_endpoints_included():
    # Before: two async endpoints of one actor interleaved at every await.
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        actor = procs.spawn("ordered", Ordered)
        first, second = actor.step.call_one("a", 0.3), actor.step.call_one("b", 0.0)
        first.get(timeout=30)
        second.get(timeout=30)
        assert actor.history.call_one().get(timeout=30) == ["a start", "a end", "b start", "b end"]


def test_thread_locals_set_in_init_are_seen_by_async_endpoints():
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        actor = procs.spawn("ordered", Ordered)
        assert actor.thread_state.call_one().get(timeout=30) == ("set in __init__", True)


def test_concurrent_endpoints_opt_out_of_the_order():
    from monarch_kernel import concurrent_endpoint

    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        actor = procs.spawn("ordered", Ordered)
        slow, fast = actor.side.call_one("slow", 0.5), actor.side.call_one("fast", 0.0)
        assert fast.get(timeout=30) == "fast" and slow.get(timeout=30) == "slow"
        log = actor.history.call_one().get(timeout=30)
        assert log.index("fast end") < log.index("slow end"), log

    with pytest.raises(ValueError, match="concurrent_endpoint can only wrap async endpoints"):
        @concurrent_endpoint
        def sync_one(self):  # noqa: ANN202
            return 1
    with pytest.raises(ValueError, match="concurrent_endpoint does not wrap @endpoint"):
        concurrent_endpoint(endpoint(lambda self: None))
    with pytest.raises(ValueError, match="can only wrap async endpoints"):
        endpoint(concurrent=True)(lambda self: None)
