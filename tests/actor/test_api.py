"""The public API against real rank processes: adverbs, ValueMesh, slicing, futures in
threads and event loops, actors calling actors, and the names the package exports."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from support.actors import Counter

import monarch_kernel
from monarch_kernel import (
    Actor,
    ActorError,
    Channel,
    Point,
    Port,
    ValueMesh,
    current_rank,
    endpoint,
    this_host,
)

pytestmark = pytest.mark.timeout(60)

PUBLIC = {
    "Accumulator", "Actor", "ActorError", "ActorMesh", "Channel", "Endpoint", "Extent", "Future", "HostMesh",
    "HangError", "MeshFailure", "MeshStopped", "Point", "Port", "PortReceiver", "ProcMesh", "ProcessDied",
    "RDMABuffer", "RestartEvent", "RestartPolicy", "Shape", "ValueMesh",
    "concurrent_endpoint", "context", "current_actor_name", "current_rank", "current_size", "endpoint",
    "get_or_spawn_controller",
    "shutdown_context", "this_host", "this_proc", "unhandled_fault_hook",
    "attach_to_workers", "run_worker_loop_forever",
    "history", "history_root", "metric",
    "RemoteException", "Stream", "Tensor", "call_on_shard_and_fetch", "fetch_shard", "get_active_mesh",
    "get_active_stream", "grad_function", "grad_generator", "inspect", "no_mesh", "reduce", "reduce_", "remote",
    "send", "show", "slice_mesh", "to_mesh",
}


class Relay(Actor):
    """Holds a reference to another mesh and calls it directly, rank to rank."""

    @endpoint
    def init(self, other) -> None:
        self.other = other

    @endpoint
    def forward_sync(self, x: int) -> list:
        # A sync endpoint may block on a call to another mesh without deadlocking.
        return list(self.other.incr.call(x).get(timeout=20).values())

    @endpoint
    async def forward_async(self, x: int) -> list:
        vm = await self.other.incr.call(x)
        return list(vm.values())


@pytest.fixture
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 4})
    yield pm
    pm.stop().get(timeout=20)


def test_public_names_are_pinned():
    assert set(monarch_kernel.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(monarch_kernel, name), name


def test_call_returns_value_mesh(procs):
    counters = procs.spawn("counters", Counter, 10)
    vm = counters.incr.call(5).get(timeout=20)
    assert isinstance(vm, ValueMesh)
    assert len(vm) == 4
    assert list(vm.values()) == [15, 15, 15, 15]
    assert vm[{"gpus": 2}] == 15
    points = [p for p, _ in vm.items()]
    assert points[3] == Point((3,), counters.extent)
    assert points[3].rank == 3 and points[3]["gpus"] == 3
    assert "ValueMesh({'gpus': 4}" in repr(vm) and "{gpus=3}: 15" in repr(vm)
    assert vm.slice(gpus=slice(0, 2)).extent == {"gpus": 2}


def test_call_one_choose_broadcast_stream(procs):
    counters = procs.spawn("counters", Counter, 0)
    one = counters.slice(gpus=1)
    assert one.incr.call_one(2).get(timeout=20) == 2
    assert one.get.call_one().get(timeout=20) == 2  # async endpoint
    counters.incr.broadcast(1)
    # Messages to one actor run in order, so the broadcast lands before this call.
    assert list(counters.get.call().get(timeout=20).values()) == [1, 3, 1, 1]
    assert counters.incr.choose(0).get(timeout=20) in (1, 3)
    order = [f.get() for f in counters.slow.stream(0.0)]
    assert sorted(order) == [0, 1, 2, 3]


class Gate(Actor):
    @endpoint
    def answer(self, held: int, release: str, timeout: float) -> tuple[int, bool]:
        """Answer at once, except rank ``held``: it waits for the file ``release`` first (up
        to ``timeout`` s).  Returns the rank and whether it waited for nothing or was released."""
        rank = current_rank().rank
        if rank == held:
            deadline = time.monotonic() + timeout
            while not os.path.exists(release):
                if time.monotonic() > deadline:
                    return rank, False
                time.sleep(0.01)
        return rank, True


def test_stream_yields_in_answer_order(procs, tmp_path):
    gates = procs.spawn("gates", Gate)
    release = tmp_path / "release-rank-0"
    # Rank 0 cannot answer until this test releases it, which it does only once the other
    # three answers came out of the stream: a stream that waited for rank 0 would first
    # yield rank 0's answer after its 20 s wait ran out, (0, False).
    stream = gates.answer.stream(0, str(release), 20.0)
    fast = [next(stream).get(timeout=30) for _ in range(3)]
    assert sorted(fast) == [(1, True), (2, True), (3, True)], f"the stream waited for the held rank: {fast}"
    release.touch()
    assert next(stream).get(timeout=20) == (0, True)
    assert list(stream) == []


def test_slicing_and_points(procs):
    counters = procs.spawn("counters", Counter, 0)
    rank, coords, size, msg_rank = counters.slice(gpus=2).where.call_one().get(timeout=20)
    assert (rank, coords, size, msg_rank) == (2, {"gpus": 2}, {"gpus": 4}, 0)
    sub = counters.slice(gpus=slice(1, 4, 2))
    assert sub.extent == {"gpus": 2}
    assert [v[0] for v in sub.where.call().get(timeout=20).values()] == [1, 3]
    assert [v[3] for v in sub.where.call().get(timeout=20).values()] == [0, 1]


def test_two_dim_mesh_slices():
    with this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}) as pm:
        counters = pm.spawn("counters", Counter, 0)
        vm = counters.where.call().get(timeout=20)
        assert vm.extent == {"hosts": 2, "gpus": 2}
        assert vm[{"hosts": 1, "gpus": 0}][1] == {"hosts": 1, "gpus": 0}
        col = counters.slice(gpus=1)
        assert col.extent == {"hosts": 2}
        assert [v[0] for v in col.where.call().get(timeout=20).values()] == [1, 3]
        me = counters.slice(**{"hosts": 1, "gpus": 1})
        assert me.where.call_one().get(timeout=20)[0] == 3


def test_await_in_running_loop_and_get_in_threads(procs):
    counters = procs.spawn("counters", Counter, 0)

    async def main():
        vm = await counters.incr.call(1)
        one = await counters.slice(gpus=0).get.call_one()
        # .get() also works inside a running loop (it blocks that thread, as documented).
        blocked = counters.slice(gpus=1).get.call_one().get(timeout=20)
        return list(vm.values()), one, blocked

    assert asyncio.run(main()) == ([1, 1, 1, 1], 1, 1)

    results, errors = [], []

    def worker(i):
        try:
            results.append(counters.slice(gpus=i).incr.call_one(10).get(timeout=20))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(results) == [11, 11, 11, 11]


def test_future_timeout_then_result(procs):
    counters = procs.spawn("counters", Counter, 0)
    fut = counters.slice(gpus=0).slow.call_one(1.5)
    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        fut.get(timeout=0.2)
    assert fut.get(timeout=20) == 0


def test_actor_mesh_passed_to_another_actor_calls_rank_to_rank(procs):
    counters = procs.spawn("counters", Counter, 0)
    with this_host().spawn_procs(per_host={"gpus": 2}) as other:
        relays = other.spawn("relays", Relay)
        relays.init.call(counters).get(timeout=20)
        assert relays.slice(gpus=0).forward_sync.call_one(1).get(timeout=20) == [1, 1, 1, 1]
        assert relays.slice(gpus=1).forward_async.call_one(1).get(timeout=20) == [2, 2, 2, 2]


def test_endpoint_error_is_actor_error_with_cause(procs):
    counters = procs.spawn("counters", Counter, 0)
    with pytest.raises(ActorError) as info:
        counters.incr.call("not an int").get(timeout=20)
    err = info.value
    assert isinstance(err.__cause__, TypeError)
    assert "Traceback of where the remote call failed" in str(err) and "self.value += by" in str(err)
    assert all(isinstance(v, ActorError) for v in err.results.values())


def test_unknown_endpoint_names_the_endpoints(procs):
    counters = procs.spawn("counters", Counter, 0)
    with pytest.raises(AttributeError,
                       match="Counter has no endpoint 'nope'; its endpoints are: get, incr, slow, where"):
        _ = counters.nope


# Classes defined in __main__ travelling by value, and Monarch's getting-started and
# ping-pong examples, are in tests/parity/test_monarch_examples.py.


class Answerer(Actor):
    @endpoint(explicit_response_port=True)
    def later(self, port: Port, x: int) -> None:
        threading.Timer(0.05, port.send, args=(x * 2,)).start()

    @endpoint(explicit_response_port=True)
    async def fails(self, port: Port, x: int) -> None:
        port.exception(ValueError(f"bad {x}"))

    @endpoint
    def report(self, port: Port) -> None:
        port.send(current_rank().rank)


def test_explicit_response_port_and_channel(procs):
    answerers = procs.spawn("answerers", Answerer)
    assert list(answerers.later.call(4).get(timeout=20).values()) == [8, 8, 8, 8]
    with pytest.raises(ActorError, match="bad 3"):
        answerers.slice(gpus=0).fails.call_one(3).get(timeout=20)
    port, receiver = Channel.open()
    answerers.report.broadcast(port)
    got = sorted(receiver.recv().get(timeout=20) for _ in range(4))
    assert got == [0, 1, 2, 3]
