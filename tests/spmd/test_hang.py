"""The hang watchdog from a script (``spmd.watchdog(procs, T, then=...)``, issue 44 point 5):
a call whose rank makes no progress for T raises ``HangError`` naming that rank and where it
is, the call is interrupted and the mesh answers the next call; calls that keep coming back
for longer than T raise nothing, and so does a rank computing on a core others crowd out;
``then="restart"`` says what it needs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from support.actors import Sleepy

from monarch_kernel import Actor, HangError, current_rank, endpoint, this_host, this_proc
from monarch_kernel.spmd import watchdog

T = 2


@pytest.mark.timeout(120)
def test_a_stuck_rank_raises_hang_error_and_the_next_call_answers():
    reports = []
    with this_host().spawn_procs(per_host={"gpus": 2}, name="hangs") as procs:
        sleepy = procs.spawn("sleepy", Sleepy)
        sleepy.nap.call(-1, 0).get(timeout=30)
        with watchdog(procs, T, then="abort", on_report=reports.append):
            for _ in range(int(3 * T / 0.3)):  # calls that come back keep it quiet, however long in all
                sleepy.nap.call(-1, 0.3).get(timeout=30)
            assert reports == []
            start = time.monotonic()
            with pytest.raises(HangError) as info:
                sleepy.nap.call(1, 600).get(timeout=60)
            took = time.monotonic() - start
            err = info.value
            assert err.ranks == [1] and err.mesh == "hangs", err
            assert str(err).startswith(f"no progress on mesh 'hangs' for {T} s: rank 1 holds the others up "
                                       "(its stack differs from the rest): rank 1 at Sleepy.nap (actors.py:"), err
            assert "Rank 1 interrupted" in str(err), err
            assert T <= took < T + 5 + 1.5, took
            assert err.report is not None and os.path.isfile(err.report)
            with open(err.report) as f:
                assert "Stacks of mesh 'hangs'" in f.read()
            assert len(reports) == 1 and reports[0].stuck == [1]
            # The interrupted call ended on its rank: the mesh answers at once.
            assert list(sleepy.nap.call(-1, 0).get(timeout=30).values()) == [0, 1]


class Stepper(Actor):
    @endpoint
    def step(self, failing: int) -> int:
        """A collective every rank enters but ``failing``, which raises first (as a rank whose
        interpreter a fault broke does)."""
        import torch
        import torch.distributed as dist

        me = current_rank().rank
        if me == failing:
            raise RuntimeError("this rank cannot take the step")
        dist.all_reduce(torch.ones(1))
        return me


@pytest.mark.timeout(180)
def test_a_call_stuck_in_a_collective_is_a_hang_though_other_calls_to_its_mesh_come_and_go():
    """Rank 1 raises before a collective the others wait in; meanwhile another thread's calls
    to an actor of the same mesh keep being answered.  They are no progress of the stuck call:
    the flight recorder names rank 1 (behind, in no collective), and the hung all_reduce is
    torn down."""
    import threading

    from monarch_kernel.spmd import setup_torch_distributed

    with this_host().spawn_procs(per_host={"gpus": 3}, name="stuckstep") as procs:
        setup_torch_distributed(procs, "gloo")
        stepper, sleepy = procs.spawn("stepper", Stepper), procs.spawn("sleepy", Sleepy)
        stop, answered = threading.Event(), []

        def other_calls() -> None:  # one in flight nearly always, to one rank then the next
            while not stop.is_set():
                r = len(answered) % 3
                answered.append(sleepy.slice(gpus=r).nap.call_one(r, 0.05).get(timeout=30))

        caller = threading.Thread(target=other_calls, daemon=True)
        caller.start()
        try:
            with watchdog(procs, T, then="abort") as watch:
                fut = stepper.step.call(1)
                with pytest.raises(HangError) as info:
                    fut.get(timeout=60)
            n = len(answered)
        finally:
            stop.set()
            caller.join(timeout=30)
        assert n >= T / 0.1, n  # the other calls went on all along
        err = info.value
        assert err.ranks == [1] and "the flight recorder" in str(err), err
        assert len(watch.reports) == 1
        assert list(sleepy.nap.call(-1, 0).get(timeout=30).values()) == [0, 1, 2]


HOG = "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"


class Starved(Actor):
    @endpoint
    def compute(self, seconds: float) -> float:
        """Pure Python for ``seconds`` on CPU 0, at nice 19 and SCHED_IDLE (this thread only) beside two
        processes spinning there at nice 0 (in this rank's session, so the scheduler weighs them
        against it): the share of a core it got."""
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)  # after the hogs start: they would inherit it
            # SCHED_IDLE (this thread only): so starved that it may not run at all between two of
            # the watchdog's samples, where the kernel has not yet counted its wait (a loaded CI).
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setaffinity(0, {0})
            start, cpu, n = time.monotonic(), time.thread_time(), 0
            while time.monotonic() - start < seconds:
                n += 1
            return (time.thread_time() - cpu) / max(1e-9, time.monotonic() - start)
        finally:
            for h in hogs:
                h.kill()
                h.wait()

    @endpoint
    def ready(self) -> bool:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="this kernel keeps no schedstat")
@pytest.mark.timeout(120)
def test_a_rank_computing_on_a_crowded_core_is_progress():
    reports = []
    with this_host().spawn_procs(per_host={"gpus": 2}, name="starved") as procs:
        starved = procs.spawn("starved", Starved)
        starved.ready.call().get(timeout=30)
        with watchdog(procs, T, then="abort", on_report=reports.append):
            share = starved.compute.call(3 * T).get(timeout=60)
        assert reports == []
        assert max(share.values()) < 0.10, f"the ranks were not crowded out (shares of a core: {share})"


class Slow(Actor):
    """Hosted by the controller (as the loss plot is): one endpoint that takes long."""

    @endpoint
    def work(self, seconds: float) -> bool:
        time.sleep(seconds)
        return True


class Asker(Actor):
    @endpoint
    def ask(self, slow, seconds: float) -> bool:
        return slow.work.call_one(seconds).get(timeout=60)


@pytest.mark.timeout(120)
def test_ranks_waiting_on_an_actor_the_controller_hosts_while_it_works_are_not_stuck():
    """The DDP notebook's ranks wait in ``plot.flush()`` while the kernel draws the plot: the
    controller is busy for them, which is progress, not a hang."""
    reports = []
    slow = this_proc().spawn("slow", Slow)
    with this_host().spawn_procs(per_host={"gpus": 2}, name="asking") as procs:
        askers = procs.spawn("askers", Asker)
        askers.ask.call(slow, 0).get(timeout=30)
        with watchdog(procs, T, then="abort", on_report=reports.append):
            assert list(askers.ask.call(slow, 3 * T).get(timeout=60).values()) == [True, True]
        assert reports == []


class Deep(Actor):
    """A rank whose own stack dump is dear: many threads, each deep in calls."""

    @endpoint
    def crowd(self, threads: int, depth: int) -> int:
        import threading

        def down(n: int) -> None:
            if n:
                down(n - 1)
            else:
                threading.Event().wait()

        for _ in range(threads):
            threading.Thread(target=down, args=(depth,), daemon=True).start()
        return threads

    @endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return current_rank().rank


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="this kernel keeps no schedstat")
@pytest.mark.timeout(120)
def test_one_stall_is_reported_once_though_dumping_its_stacks_costs_cpu():
    """The CPU a rank spends on the watchdog's own stack dump (here 48 threads 400 calls
    deep: tens of ms, as a small dump costs on a crowded machine) is not its progress."""
    reports = []
    with this_host().spawn_procs(per_host={"gpus": 1}, name="deep") as procs:
        deep = procs.spawn("deep", Deep)
        deep.crowd.call(48, 400).get(timeout=30)
        with watchdog(procs, T, then="dump", on_report=reports.append) as watch:
            deep.nap.call(3 * T + 1).get(timeout=60)
        assert len(reports) == 1, ([r.headline() for r in reports], list(watch.rearmed))


class SlowDump(Actor):
    """A rank whose own stack dump takes seconds of CPU, as a deep one does on a crowded
    machine: longer than ``procs.stacks`` waits for it before reading the rank with py-spy."""

    @endpoint
    def slow_dumps(self, seconds: float) -> None:
        from monarch_kernel.runtime.spawn import stack_dump

        plain = stack_dump.threads_now

        def dear() -> list:
            out = plain()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
            return out

        stack_dump.threads_now = dear

    @endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return current_rank().rank


@pytest.mark.timeout(120)
def test_a_dump_still_running_after_the_report_is_not_progress():
    """The CPU of a dump the report asked for counts as progress only once the rank was seen
    idle: a 2.5 s dump (py-spy read the rank meanwhile) does not end the stall, so the same
    stall is not reported a second time."""
    reports = []
    with this_host().spawn_procs(per_host={"gpus": 1}, name="slowdump") as procs:
        rank = procs.spawn("rank", SlowDump)
        rank.slow_dumps.call(2.5).get(timeout=30)
        with watchdog(procs, T, then="dump", on_report=reports.append) as watch:
            rank.nap.call(5 * T).get(timeout=60)
        assert len(reports) == 1, ([r.headline() for r in reports], list(watch.rearmed))


def test_restart_needs_a_restart_policy():
    with pytest.raises(ValueError, match="needs a restart policy"):
        watchdog(None, 5, then="restart")
    with pytest.raises(ValueError, match="choose 'dump'"):
        watchdog(None, 5, then="later")


class Napper(Actor):
    @endpoint(retries=1)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return current_rank().rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.timeout(120)
def test_restart_kills_a_stopped_rank_and_its_replacement_answers_the_retried_call():
    reports = []
    with this_host().spawn_procs(per_host={"gpus": 2}, name="stuck") as procs:
        nappers = procs.spawn("nappers", Napper)
        pids = list(nappers.pid.call().get(timeout=30).values())
        with pytest.raises(ValueError, match=r"procs.set_restart_policy\('on-failure'\) first"):
            watchdog(procs, T, then="restart")
        procs.set_restart_policy("on-failure")
        with watchdog(procs, T, then="restart", on_report=reports.append):
            call = nappers.nap.call(1.0)
            os.kill(pids[1], signal.SIGSTOP)  # it never answers: a hang, not a death
            assert list(call.get(timeout=60).values()) == [0, 1]  # rank 1's answer: its replacement's
        event = procs.events()[0]
        assert (event.kind, event.ranks, event.reason) == ("restart", (1,), "hung"), event
        assert reports[0].stuck == [1] and "Rank 1 killed, to be replaced" in reports[0].actions[0]
        assert list(nappers.pid.call().get(timeout=30).values())[1] not in pids
