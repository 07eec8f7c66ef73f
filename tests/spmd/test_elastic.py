"""``elastic_run`` with real ranks: a rank SIGKILLed mid-loop and replaced under the restart
policy (the final loss equals an uninterrupted run's), the job shrinking when restarts are
off, and growing back when the rank returns; state from peers' memory only.  And the races
of a rebuild, made to happen with ``on_rebuild`` holding it: a rank back while the shrunk
group is made, a second death while it is made, a rank back before the shrunk group exists.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from support.templates import templates_of_this_process

from monarch_kernel import Actor, this_host
from monarch_kernel.spmd import Resize, elastic_run, elastic_steps

pytestmark = pytest.mark.timeout(300)

STEPS = 60
GROW_STEPS = 400  # the survivors train on while a rank brought back starts (and imports torch)


def train(steps: int, progress: str, name: str, fail: tuple = ()) -> dict:
    """DDP on a small MLP, each rank its own minibatches (seeded by step and rank); rank 0
    writes ``step world`` to ``progress`` after each step.  ``fail``: ``(rank, step)`` where
    that rank raises (without dying)."""
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
    done, loss, first_at = [], None, None
    for step in elastic_steps(steps, model, opt, name=name):
        if fail == (rank, step):
            raise ValueError(f"a bad batch at step {step}")
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = F.cross_entropy(ddp(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        done.append(step + 1)
        first_at = first_at or time.monotonic()  # (one clock for the ranks and the test: one host)
        if rank == 0:
            with open(progress + ".tmp", "w") as f:
                f.write(f"{step + 1} {world} {time.time()}")
            os.replace(progress + ".tmp", progress)
        time.sleep(0.02)  # so that a death lands mid-loop
    return {"steps": done, "world": world, "loss": None if loss is None else loss.item(),
            "params": [p.detach().clone() for p in model.parameters()], "first_at": first_at}


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


def _until(what, why: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {why}")
        time.sleep(0.02)


class ImportsTorch(Actor):
    """Imports torch.distributed on its rank, so that a rank brought back answers
    elastic_run at once (as one forked from the warm template does)."""

    def __init__(self):
        import torch.distributed  # noqa: F401


def _bring_back(procs, rank: int) -> None:
    """``procs.restart([rank])`` (as a user adding a host back), then torch imported there."""
    procs.restart([rank])
    procs.flatten("rank").slice(rank=rank).spawn("imports_torch", ImportsTorch).initialized().get(timeout=120)


def _converged(run, world: int, steps: int = STEPS) -> None:
    """Every member ended at the last step in one group of ``world`` ranks, with the same
    steps and weights (the ranks that joined read the state from a survivor)."""
    values = run.values
    assert len(values) == world and {v["world"] for v in values.values()} == {world}, run
    first = values[run.members[0]]
    for v in values.values():
        assert v["steps"] == first["steps"] and v["steps"][-1] == steps, (v["steps"], first["steps"])
        for a, b in zip(v["params"], first["params"], strict=True):
            assert a.equal(b)


@pytest.fixture
def procs():
    procs = this_host().spawn_procs(per_host={"gpus": 3})
    yield procs
    procs.stop().get(timeout=30)


def test_an_abort_sent_after_the_mesh_was_stopped_ends_quietly(procs):
    # The abort of a broken group runs on its own thread; the user (or a test's teardown)
    # may stop the mesh before it sends: it must end without an exception (CI on d23ce36).
    from monarch_kernel.spmd.controller.elastic import _abort
    from monarch_kernel.spmd.rank.elastic import ElasticControl

    control = procs.slice(gpus=0).spawn("elastic_control", ElasticControl)
    procs.stop().get(timeout=30)
    _abort([control], "a test", 1)  # raised MeshStopped from the send


def test_resize_is_a_signal_not_an_error():
    assert Resize(4).step == 4 and "step 4" in str(Resize(4))


def test_with_restarts_off_it_shrinks_then_grows_back_when_the_rank_returns(procs, tmp_path):
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 2, progress, 15)

    def bring_back():  # "the user adds one": once the job went on with two ranks
        _wait_for(progress, lambda s, w, at: w == 2 and s >= 25)
        _bring_back(procs, 2)

    grower = threading.Thread(target=bring_back, daemon=True)
    grower.start()
    run = elastic_run(procs, train, GROW_STEPS, progress, "shrink")
    killer.join(5)
    grower.join(5)
    assert [(c.kind, c.ranks) for c in run.changes] == [("shrunk", (2,)), ("grown", (2,))], run.changes
    assert run.changes[0].world_size == 2 and run.changes[1].world_size == 3
    assert run.members == (0, 1, 2)
    values = run.values
    # The last attempt: every member ends at the last step, in one group of three.
    assert {v["world"] for v in values.values()} == {3}
    assert all(v["steps"][-1] == GROW_STEPS for v in values.values())
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


def test_a_hung_rank_under_then_abort_ends_the_run_with_hang_error_and_the_next_run_trains(procs, tmp_path):
    """``then="abort"`` in an elastic job: the loop waits on its members' calls as any call is
    waited on, so the watchdog's HangError lands in it (before, it polled, never took it, and
    waited for ever on the stopped rank's call), and the job's group is aborted on every
    member.  The mesh stays usable: once the rank runs again, the next run trains."""
    from monarch_kernel import HangError
    from monarch_kernel.spmd import watchdog

    progress = str(tmp_path / "step")
    victim = procs.rank_states()[1]["pid"]

    def stop():
        _wait_for(progress, lambda s, w, at: s >= 15)
        os.kill(victim, signal.SIGSTOP)

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    try:
        with watchdog(procs, 3, then="abort"), pytest.raises(HangError) as raised:
            elastic_run(procs, train, GROW_STEPS, progress, "hung-abort")
    finally:
        stopper.join(5)
        os.kill(victim, signal.SIGCONT)
    assert raised.value.ranks == [1], raised.value
    run = elastic_run(procs, train, STEPS, progress, "after-abort")
    assert run.changes == [] and sorted(run.values) == [0, 1, 2], run
    assert all(v["steps"][-1] == STEPS for v in run.values.values())


def _templates() -> list[int]:
    """The pids of this process's templates: the ones that fork ranks, and a replacement
    (from the warm standby, if one was started)."""
    return [pid for pid, _argv in templates_of_this_process()]


def test_a_rank_restarted_by_hand_joins_once_its_new_process_answers(procs, tmp_path):
    """The race that stopped the DDP notebook's shrink-and-grow: restarts off, rank 2 dies,
    two ranks train on, and ``procs.restart([2])`` brings it back.  Its death is forgotten
    at once, but its new process exists only once a template forked it: the templates are
    held (SIGSTOP) in between.  Before, the job counted rank 2 in at once, left the loop
    and called the actors of its dead process, which nobody would ever answer."""
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 2, progress, 15)
    templates = _templates()
    assert templates
    seen: dict = {}

    def bring_back():
        _wait_for(progress, lambda s, w, at: w == 2)
        for t in templates:
            os.kill(t, signal.SIGSTOP)
        try:
            restarting = threading.Thread(target=procs.restart, args=([2],), daemon=True)
            restarting.start()
            _until(lambda: 2 not in procs.dead_ranks(), "rank 2's death to be forgotten")
            now = _progress(progress)[0]
            try:  # the two ranks go on meanwhile
                _wait_for(progress, lambda s, w, at: s >= now + 10, timeout=20)
            except AssertionError as e:
                seen["stalled"] = str(e)
        finally:
            for t in templates:
                os.kill(t, signal.SIGCONT)
        restarting.join(60)
        procs.flatten("rank").slice(rank=2).spawn("imports_torch", ImportsTorch).initialized().get(timeout=120)

    grower = threading.Thread(target=bring_back, daemon=True)
    grower.start()
    try:
        run = elastic_run(procs, train, GROW_STEPS, progress, "held-fork")
    finally:
        for t in templates:
            os.kill(t, signal.SIGCONT)
    killer.join(5)
    grower.join(60)
    assert not seen, seen
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("shrunk", (2,), 2), ("grown", (2,), 3)], \
        run.changes
    _converged(run, 3, GROW_STEPS)


def test_a_rank_back_while_the_shrunk_group_is_made_joins_at_the_next_step(procs, tmp_path):
    """The race that hung the DDP notebook: restarts off, rank 2 SIGKILLed, and brought back
    while the group of the two survivors is being made."""
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 2, progress, 15)
    held = []

    def on_rebuild(stage: str, generation: int, members: tuple) -> None:
        if stage == "placed" and members == (0, 1) and not held:
            held.append(generation)
            _bring_back(procs, 2)  # the survivors' store is served, their group not yet made

    run = elastic_run(procs, train, STEPS, progress, "back-mid-rebuild", on_rebuild=on_rebuild)
    killer.join(5)
    assert held, "the rebuild without rank 2 was never held"
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("shrunk", (2,), 2), ("grown", (2,), 3)], \
        run.changes
    assert run.members == (0, 1, 2)
    _converged(run, 3)
    assert all(c.seconds < 60 for c in run.changes)


def test_a_second_death_while_the_group_is_made_aborts_that_rendezvous(procs, tmp_path):
    """Rank 1 dies while the group without rank 2 is being made: rank 0, waiting in torch's
    rendezvous for rank 1, is freed at once if rank 1 had not yet given its address (the store
    is closed), or within rendezvous_timeout if it had (gloo retries connecting to it until the
    group's init timeout), not at the group's 300 s timeout, and trains on alone."""
    progress = str(tmp_path / "step")
    killer = _kill_at(procs, 2, progress, 15)
    held = []

    def on_rebuild(stage: str, generation: int, members: tuple) -> None:
        if stage == "making" and members == (0, 1) and not held:  # rank 0 is in torch's rendezvous
            held.append(time.monotonic())
            os.kill(procs.rank_states()[1]["pid"], signal.SIGKILL)
            _until(lambda: 1 in procs.dead_ranks(), "rank 1 to die")

    run = elastic_run(procs, train, STEPS, progress, "second-death", on_rebuild=on_rebuild, rendezvous_timeout=10)
    killer.join(5)
    assert held, "the rebuild without rank 2 was never held"
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("shrunk", (1, 2), 1)], run.changes
    assert "rank 1 killed by signal 9" in run.changes[0].cause and "rank 2 killed by signal 9" in run.changes[0].cause
    assert run.members == (0,)
    _converged(run, 1)
    # The next step at one rank came within rendezvous_timeout and seconds of the second death.
    assert run.values[0]["first_at"] - held[0] < 40, run.values[0]["first_at"] - held[0]


def test_a_rank_back_before_the_shrunk_group_exists_is_replaced_instead(procs, tmp_path):
    """Rank 2 dies and is back (restarts off, restarted by hand) before the survivors'
    group is made: the job goes straight back to three ranks, and the final loss and weights
    equal an uninterrupted run's."""
    progress = str(tmp_path / "step")
    calm = elastic_run(procs, train, STEPS, progress, "calm")
    killer = _kill_at(procs, 2, progress + "2", 20)
    held = []

    def on_rebuild(stage: str, generation: int, members: tuple) -> None:
        if stage == "lost" and not held:
            held.append(generation)
            _bring_back(procs, 2)  # the shrink is pending: no group without rank 2 made yet

    run = elastic_run(procs, train, STEPS, progress + "2", "back-before-shrink", on_rebuild=on_rebuild)
    killer.join(5)
    assert held, "the rebuild after rank 2's death was never held"
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("replaced", (2,), 3)], run.changes
    _converged(run, 3)
    first = run.values[2]["steps"][0]
    assert 20 <= first <= 22 and run.values[2]["steps"] == list(range(first, STEPS + 1))  # at most one step again
    for r in range(3):
        assert run.values[r]["loss"] == calm.values[r]["loss"], (r, first)
        for a, b in zip(run.values[r]["params"], calm.values[r]["params"], strict=True):
            assert a.equal(b)


@pytest.mark.timeout(150)
def test_a_member_that_fails_without_dying_has_the_others_group_aborted_at_once(procs, tmp_path):
    """Rank 1's function raises at step 10 (it does not die): ranks 0 and 2, in their next
    all-reduce, are freed at once and elastic_run raises rank 1's error, instead of waiting
    in gloo for group_timeout (300 s; the cell's 240 s timeout fired first in the DDP
    notebook).  The mesh stays usable: the next run trains."""
    progress = str(tmp_path / "step")
    t0 = time.monotonic()
    with pytest.raises(Exception, match="a bad batch at step 10") as info:
        elastic_run(procs, train, STEPS, progress, "fails", (1, 10))
    assert time.monotonic() - t0 < 60, time.monotonic() - t0
    assert type(info.value).__name__ == "ActorError", info.value
    run = elastic_run(procs, train, 5, progress + "2", "after")
    assert run.changes == [] and all(v["steps"][-1] == 5 for v in run.values.values())


@pytest.mark.timeout(150)
def test_a_wedged_rendezvous_fails_within_rendezvous_timeout_saying_where(procs, tmp_path):
    """A member that never joins the rendezvous (stopped, not dead): elastic_run aborts it on
    every member and raises within rendezvous_timeout, naming the rank and where each
    member's threads are, instead of sitting for group_timeout (300 s)."""
    progress = str(tmp_path / "step")
    stopped = []

    def on_rebuild(stage: str, generation: int, members: tuple) -> None:
        if stage == "making" and not stopped:
            pid = procs.rank_states()[1]["pid"]
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"not made within 5 s \(elastic_run's rendezvous_timeout\): "
                                               r"ranks \[1\] did not answer") as info:
            elastic_run(procs, train, STEPS, progress, "wedged", rendezvous_timeout=5, on_rebuild=on_rebuild)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped and time.monotonic() - t0 < 60, time.monotonic() - t0
    assert "where their threads were:" in str(info.value), info.value
