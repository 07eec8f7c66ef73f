"""An actor's event loop lives as long as the actor, as Monarch's does: tasks its async
endpoints start keep running between calls, interleave with its endpoints, and stop (then
``__cleanup__`` runs) when the actor stops.  Actors spawned back to back on one fresh proc,
each unpickling a torch module, import torch one at a time.  Real ranks throughout."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from support.actors import wait_until

from monarch_kernel import Actor, Channel, context, endpoint, send, this_host

pytestmark = pytest.mark.timeout(120)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


class Ticker(Actor):
    """A background task counts every 10 ms; the endpoints only start it and read it."""

    def __init__(self, log: str):
        self.log = log
        self.count = 0

    def _say(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(what + "\n")

    @endpoint
    async def start(self) -> int:
        self.task = asyncio.create_task(self._tick())
        return self.count

    async def _tick(self) -> None:
        self.task_thread = threading.current_thread().name
        try:
            while True:
                self.count += 1
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self._say("cancelled")
            raise

    @endpoint
    async def read(self) -> int:
        await asyncio.sleep(0)
        return self.count

    @endpoint
    def read_sync(self) -> int:
        return self.count

    @endpoint
    def threads(self) -> tuple[str, str]:
        """Where its sync endpoints run, and where its task runs."""
        return threading.current_thread().name, self.task_thread

    def __cleanup__(self, exc) -> None:
        self._say(f"cleanup-{type(exc).__name__}")


class MainThreadTicker(Ticker):
    runs_on_main_thread = True  # as the notebook's console: its worker, loop included, is the main thread


@pytest.mark.parametrize("cls", [Ticker, MainThreadTicker])
def test_a_task_an_endpoint_started_runs_between_calls_and_stops_with_the_actor(tmp_path, cls):
    log = str(tmp_path / "log")
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        ticker = procs.spawn("ticker", cls, log)
        assert ticker.start.call_one().get(timeout=30) <= 1
        # Nobody calls it meanwhile: the count moves on its own (about 100 a second).
        seen: list[int] = []
        wait_until(lambda: seen.append(ticker.read_sync.call_one().get(timeout=30)) or seen[-1] > 50, 30,
                   "the ticker's background task to count past 50 between calls")
        first = ticker.read.call_one().get(timeout=30)
        wait_until(lambda: ticker.read.call_one().get(timeout=30) > first + 20, 30,
                   "the count to move on after an async endpoint read it")
        endpoint_thread, task_thread = ticker.threads.call_one().get(timeout=30)
        assert endpoint_thread == task_thread  # one worker runs the actor's code and its loop
        assert (endpoint_thread == "MainThread") == (cls is MainThreadTicker)
        ticker.stop().get(timeout=30)
        assert _lines(log) == ["cancelled", "cleanup-NoneType"]


class Producer(Actor):
    """Like a generator of rollouts: a task sends into a port each time it is given credit."""

    def __init__(self):
        self.rank = int(context().actor_instance.rank.rank)
        self.credit = asyncio.Semaphore(0)
        self.version = 0

    @endpoint
    async def start(self, port) -> None:
        self.credit.release()  # the first one is free
        self.task = asyncio.create_task(self._produce(port))

    async def _produce(self, port) -> None:
        while True:
            await self.credit.acquire()
            await asyncio.sleep(0.002)  # a rollout takes a while
            port.send((self.rank, self.version))

    @endpoint
    def update(self, version: int) -> None:  # sync, as weight updates often are
        self.version = version
        self.credit.release()


class Consumer(Actor):
    """Like a trainer: takes what the producers send and hands the next credit to one of them."""

    @endpoint
    async def run(self, producers, rounds: int) -> dict:
        port, receiver = Channel.open()
        await producers.start.call(port)
        counts: dict[int, int] = {}
        for step in range(rounds):
            rank, version = await receiver.recv()
            counts[rank] = counts.get(rank, 0) + 1
            send(producers.update, (step + 1,), {}, selection="choose")
        return counts


def test_a_producer_task_feeds_a_port_while_a_consumer_sends_back_with_choose():
    rounds = 200
    with this_host().spawn_procs(per_host={"r": 3}) as procs:
        producers = procs.slice(r=slice(0, 2)).spawn("producers", Producer)
        consumer = procs.slice(r=2).spawn("consumer", Consumer)
        counts = consumer.run.call_one(producers, rounds).get(timeout=90)
        # Two started with one credit each; every value received gave one more to one of them.
        assert sum(counts.values()) == rounds
        assert set(counts) <= {0, 1}


class Holder(Actor):
    """Constructed with a torch module: unpickling it imports torch on a fresh rank."""

    def __init__(self, module):
        self.kind = type(module).__name__

    @endpoint
    def kind_and_pid(self) -> tuple[str, int]:
        return self.kind, os.getpid()


def _torch_modules() -> list:
    """Four whose unpickling starts torch's import from four different submodules, the way
    that breaks it when threads race (each takes its submodule's import lock first)."""
    import torch

    return [torch.nn.Linear(2, 1), torch.nn.ReLU(), torch.nn.Embedding(3, 2), torch.nn.LayerNorm(2)]


@pytest.mark.timeout(400)
def test_actors_spawned_together_on_a_fresh_proc_unpickle_torch_one_at_a_time():
    # 2 proc meshes of 4 fresh ranks: 8 fresh processes, each given 4 actors back to back
    # (spawn does not wait), each actor's argument a torch module whose unpickling imports
    # torch.  Before, torch's import broke in most of them ("partially initialized module"),
    # so 8 tries cannot all miss it.
    modules = _torch_modules()
    for _mesh in range(2):
        with this_host().spawn_procs(per_host={"r": 4}) as procs:
            meshes = [procs.spawn(f"holder{i}", Holder, m) for i, m in enumerate(modules)]
            for holders, module in zip(meshes, modules, strict=True):
                got = list(holders.kind_and_pid.call().get(timeout=240).values())
                assert [kind for kind, _pid in got] == [type(module).__name__] * 4
