"""``elastic_run`` with real ranks: a rank SIGKILLed mid-loop and replaced under the restart
policy (the final loss equals an uninterrupted run's), the job shrinking when restarts are
off, and growing back when the rank returns; state from peers' memory only.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from monarch_kernel import this_host
from monarch_kernel.spmd import Resize, elastic_run, elastic_steps

pytestmark = pytest.mark.timeout(300)

STEPS = 60


def train(steps: int, progress: str, name: str) -> dict:
    """DDP on a small MLP, each rank its own minibatches (seeded by step and rank); rank 0
    writes ``step world`` to ``progress`` after each step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # DDP rebuilds its gradient buckets after its first step, and gloo's sums follow their
    # layout: a resumed run (a fresh DDP) would differ from an uninterrupted one in the last
    # bits.  With find_unused_parameters DDP keeps its first layout: bit for bit the same.
    ddp = DDP(model, find_unused_parameters=True)
    teacher = torch.randn(8, 2, generator=torch.Generator().manual_seed(5))
    done, loss = [], None
    for step in elastic_steps(steps, model, opt, name=name):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = F.cross_entropy(ddp(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        done.append(step + 1)
        if rank == 0:
            with open(progress + ".tmp", "w") as f:
                f.write(f"{step + 1} {world} {time.time()}")
            os.replace(progress + ".tmp", progress)
        time.sleep(0.02)  # so that a death lands mid-loop
    return {"steps": done, "world": world, "loss": None if loss is None else loss.item(),
            "params": [p.detach().clone() for p in model.parameters()]}


def _progress(path: str) -> tuple[int, int, float]:
    try:
        with open(path) as f:
            step, world, at = f.read().split()
        return int(step), int(world), float(at)
    except (OSError, ValueError):
        return 0, 0, 0.0


def _wait_for(path: str, what, timeout: float = 120) -> tuple[int, int, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _progress(path)
        if what(*got):
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for rank 0's progress in {path} "
                         f"(last: {_progress(path)})")


def _kill_at(procs, rank: int, path: str, step: int) -> threading.Thread:
    victim = procs.rank_states()[rank]["pid"]

    def go():
        _wait_for(path, lambda s, w, at: s >= step)
        os.kill(victim, signal.SIGKILL)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.fixture
def procs():
    procs = this_host().spawn_procs(per_host={"gpus": 3})
    yield procs
    procs.stop().get(timeout=30)


def test_resize_is_a_signal_not_an_error():
    assert Resize(4).step == 4 and "step 4" in str(Resize(4))


def test_with_restarts_off_it_shrinks_then_grows_back_when_the_rank_returns(procs, tmp_path):
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 2, progress, 15)

    def bring_back():  # "the user adds one": once the job went on with two ranks
        _wait_for(progress, lambda s, w, at: w == 2 and s >= 25)
        procs.restart([2])

    grower = threading.Thread(target=bring_back, daemon=True)
    grower.start()
    run = elastic_run(procs, train, STEPS, progress, "shrink")
    killer.join(5)
    grower.join(5)
    assert [(c.kind, c.ranks) for c in run.changes] == [("shrunk", (2,)), ("grown", (2,))], run.changes
    assert run.changes[0].world_size == 2 and run.changes[1].world_size == 3
    assert run.members == (0, 1, 2)
    values = run.values
    # The last attempt: every member ends at the last step, in one group of three.
    assert {v["world"] for v in values.values()} == {3}
    assert all(v["steps"][-1] == STEPS for v in values.values())
    # The returned rank read the state from a survivor's memory and started where they did.
    assert values[2]["steps"] == values[0]["steps"] and values[2]["steps"][0] > 25
    for a, b in zip(values[0]["params"], values[2]["params"], strict=True):
        assert a.equal(b)
    assert all(c.seconds < 60 for c in run.changes)


def test_below_min_ranks_it_stops_and_says_what_to_do(procs, tmp_path):
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 1, progress, 5)
    with pytest.raises(RuntimeError, match=r"has 2 live ranks .*fewer than min_ranks=3: replace them"):
        elastic_run(procs, train, STEPS, progress, "min", min_ranks=3)
    killer.join(5)


def test_a_killed_rank_is_replaced_and_the_final_loss_equals_an_uninterrupted_runs(procs, tmp_path):
    progress = str(tmp_path / "step")
    calm = elastic_run(procs, train, STEPS, progress, "calm")
    assert calm.changes == []
    procs.set_restart_policy("on-failure", max_restarts=3, restart_window=600)
    killer = _kill_at(procs, 1, progress + "2", 20)
    run = elastic_run(procs, train, STEPS, progress + "2", "killed")
    killer.join(5)
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("replaced", (1,), 3)], run.changes
    assert run.members == (0, 1, 2)
    # The replacement read the state from a survivor's memory; at most one step was repeated.
    first = run.values[1]["steps"][0]
    assert 20 <= first <= 22 and run.values[1]["steps"] == list(range(first, STEPS + 1))
    # The same losses and weights as the uninterrupted run, bit for bit.
    for r in range(3):
        assert run.values[r]["loss"] == calm.values[r]["loss"], (r, first)
        for a, b in zip(run.values[r]["params"], calm.values[r]["params"], strict=True):
            assert a.equal(b)
    assert run.changes[0].seconds < 30


def test_a_hung_rank_is_killed_by_the_watchdog_replaced_and_the_loop_goes_on(tmp_path):
    from monarch_kernel.spmd import watchdog

    progress = str(tmp_path / "step")
    procs = this_host().spawn_procs(per_host={"gpus": 3}, restart="on-failure")
    try:
        victim = procs.rank_states()[1]["pid"]

        def stop():  # a rank that stops answering mid-loop (its peers wait in their all-reduce)
            _wait_for(progress, lambda s, w, at: s >= 15)
            os.kill(victim, signal.SIGSTOP)

        stopper = threading.Thread(target=stop, daemon=True)
        stopper.start()
        with watchdog(procs, 3, then="restart"):
            run = elastic_run(procs, train, 40, progress, "hung")
        stopper.join(5)
        assert [(c.kind, c.ranks) for c in run.changes] == [("replaced", (1,))], run.changes
        assert all(v["steps"][-1] == 40 for v in run.values.values())
        assert procs.rank_states()[1]["pid"] != victim
    finally:
        procs.stop().get(timeout=30)
