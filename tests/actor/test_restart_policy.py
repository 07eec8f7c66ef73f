"""The restart policy (issue 44 point 1), with real rank processes: a rank SIGKILLed is
replaced with its actors, built from their spawn arguments; ``__on_restart__`` is called on
every rank; a retried endpoint's caller sees only the result; a crash loop fails the mesh."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.actors import wait_until
from support.templates import templates_of_this_process

from monarch_kernel import Actor, current_rank, endpoint, this_host
from monarch_kernel.runtime.errors import ProcessDied

pytestmark = pytest.mark.timeout(120)


class Keeper(Actor):
    """Remembers its spawn arguments and every restart event it was told of."""

    def __init__(self, tag: str, *, scale: int = 1):
        self.tag, self.scale, self.told = tag, scale, []

    @endpoint
    def state(self) -> tuple:
        return self.tag, self.scale, os.getpid(), [(e.kind, e.ranks, e.reason) for e in self.told]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def slow(self, x: int) -> int:
        time.sleep(2)
        return x * self.scale

    @endpoint(retries=2)
    def slow_retried(self, x: int) -> int:
        time.sleep(2)
        return x * self.scale + current_rank().rank

    def __on_restart__(self, event) -> None:
        self.told.append(event)


class AsyncKeeper(Actor):
    """An async hook, on another actor mesh of the same proc mesh."""

    def __init__(self):
        self.told = []

    @endpoint
    async def heard(self) -> list:
        return self.told

    async def __on_restart__(self, event) -> None:
        self.told.append((event.mesh, event.ranks))


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_a_killed_rank_is_replaced_with_its_actors_and_the_hook_is_called():
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure", max_restarts=3, restart_window=600)
    try:
        keepers = procs.spawn("keepers", Keeper, "t", scale=3)
        asyncs = procs.spawn("asyncs", AsyncKeeper)
        before = list(keepers.pid.call().get(timeout=30).values())
        _kill(before[1])
        event = procs.wait_restart(after=0, timeout=60)
        assert (event.kind, event.ranks, event.reason, event.index) == ("restart", (1,), "died", 1)
        assert event.causes == ("killed by signal 9 (SIGKILL)",)
        assert event.pids[0] != before[1] and event.restarts == 1 and event.seconds > 0
        assert procs.events() == [event]
        # The replacement was built with the same arguments; every rank heard the hook.
        wait_until(lambda: all(s[3] for s in keepers.state.call().get(timeout=30).values()), 30,
                   "every rank to run __on_restart__")
        states = list(keepers.state.call().get(timeout=30).values())
        assert [(s[0], s[1]) for s in states] == [("t", 3), ("t", 3)]
        assert states[0][2] == before[0] and states[1][2] == event.pids[0]
        assert [s[3] for s in states] == [[("restart", (1,), "died")]] * 2
        wait_until(lambda: all(asyncs.heard.call().get(timeout=30).values()), 30, "the async hooks to run")
        assert list(asyncs.heard.call().get(timeout=30).values()) == [[(procs.name, (1,))]] * 2
    finally:
        procs.stop().get(timeout=30)


def test_a_call_in_flight_raises_process_died_unless_the_endpoint_retries():
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure")
    try:
        keepers = procs.spawn("keepers", Keeper, "t", scale=10)
        pids = list(keepers.pid.call().get(timeout=30).values())
        plain = keepers.slow.call(1)
        retried = keepers.slow_retried.call(4)
        _kill(pids[1])
        with pytest.raises(ProcessDied):
            plain.get(timeout=60)
        assert list(retried.get(timeout=60).values()) == [40, 41]  # rank 1's answer came from its replacement
        assert [e.ranks for e in procs.events()] == [(1,)]
    finally:
        procs.stop().get(timeout=30)


def test_a_crash_loop_past_max_restarts_fails_the_mesh_with_its_deaths():
    failures = []
    import monarch_kernel

    old = monarch_kernel.unhandled_fault_hook
    monarch_kernel.unhandled_fault_hook = failures.append
    procs = this_host().spawn_procs({"r": 1}, restart="on-failure", max_restarts=1, restart_window=600)
    try:
        keepers = procs.spawn("keepers", Keeper, "t")
        _kill(keepers.pid.call_one().get(timeout=30))
        procs.wait_restart(after=0, timeout=60)
        _kill(keepers.pid.call_one().get(timeout=30))
        gave_up = procs.wait_restart(after=1, timeout=60)
        assert gave_up.kind == "gave-up" and len(gave_up.deaths) == 2
        wait_until(lambda: failures, 20, "the crash loop to reach the unhandled-fault hook")
        text = str(failures[0])
        assert "crash loop: 2 deaths within 600 s, past max_restarts=1" in text
        assert text.count("rank 0 killed by signal 9 (SIGKILL)") == 2
        with pytest.raises(ProcessDied):
            keepers.pid.call_one().get(timeout=30)
    finally:
        monarch_kernel.unhandled_fault_hook = old
        procs.stop().get(timeout=30)


def test_the_policy_changes_on_a_running_mesh():
    procs = this_host().spawn_procs({"r": 1})
    try:
        assert procs.restart_policy.restart == "never"
        keepers = procs.spawn("keepers", Keeper, "late")
        policy = procs.set_restart_policy("on-failure", max_restarts=-1, restart_window=60)
        assert (policy.restart, policy.max_restarts, policy.restart_window) == ("on-failure", -1, 60.0)
        _kill(keepers.pid.call_one().get(timeout=30))
        assert procs.wait_restart(timeout=60).ranks == (0,)
        assert keepers.state.call_one().get(timeout=30)[0] == "late"
        with pytest.raises(ValueError, match="restart='sometimes'"):
            procs.set_restart_policy("sometimes")
    finally:
        procs.stop().get(timeout=30)


class Heavy(Actor):
    """Imports numpy in an endpoint (after the spawn), as a notebook's cell would."""

    def __init__(self):
        import sys

        self.warm = "numpy" in sys.modules  # imported before this rank ran any of the user's code

    @endpoint
    def load(self) -> int:
        import numpy

        return int(numpy.ones(3).sum())

    @endpoint
    def was_warm(self) -> bool:
        return self.warm


def test_a_replacement_forks_from_a_template_holding_what_the_ranks_imported():
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure")
    try:
        heavy = procs.spawn("heavy", Heavy)
        assert list(heavy.load.call().get(timeout=60).values()) == [3, 3]
        assert list(heavy.was_warm.call().get(timeout=30).values()) == [False, False]
        wait_until(lambda: "numpy" in procs.warm_standby(), 60, "the standby template to import numpy")
        _kill(procs.rank_states()[1]["pid"])
        procs.wait_restart(timeout=60)
        assert list(heavy.was_warm.call().get(timeout=30).values()) == [False, True]
    finally:
        procs.stop().get(timeout=30)


class Heavier(Heavy):
    @endpoint
    def load_more(self) -> int:
        from PIL import Image

        return Image.new("L", (2, 2)).size[0]


def _standbys_holding(module: str) -> list[int]:
    """This process's templates that import ``module``."""
    return [pid for pid, argv in templates_of_this_process() if module.encode() in argv[5:]]


def test_a_replacement_forks_from_the_ready_standby_while_a_new_one_imports_more():
    """The ranks imported more (PIL) and a new standby is importing it (held stopped here):
    a rank that dies meanwhile forks from the standby that is ready (numpy), not from a cold
    template.  (A rank restarted by hand in the DDP notebook joined its elastic job late so.)"""
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure")
    stopped: list[int] = []
    try:
        heavy = procs.spawn("heavy", Heavier)
        assert list(heavy.load.call().get(timeout=60).values()) == [3, 3]
        wait_until(lambda: "numpy" in procs.warm_standby(), 60, "the standby template to import numpy")
        assert list(heavy.load_more.call().get(timeout=60).values()) == [2, 2]
        assert procs.warm_standby() == []  # a new standby, importing PIL too
        wait_until(lambda: _standbys_holding("PIL"), 30, "the new standby to start")
        stopped = _standbys_holding("PIL")
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        _kill(procs.rank_states()[1]["pid"])
        procs.wait_restart(timeout=60)
        assert list(heavy.was_warm.call().get(timeout=30).values()) == [False, True]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        procs.stop().get(timeout=30)


def _refuse_if_marked() -> None:
    """A bootstrap that fails once the test has written its mark: the replacement cannot come up."""
    if os.path.exists(os.environ["RESTART_TEST_MARK"]):
        raise RuntimeError("this host refuses new ranks")


def test_a_replacement_that_cannot_come_up_is_a_failed_event_and_the_retried_call_raises(tmp_path):
    mark = tmp_path / "mark"
    procs = this_host().spawn_procs({"r": 2}, bootstrap=_refuse_if_marked, env={"RESTART_TEST_MARK": str(mark)},
                                    restart="on-failure")
    try:
        keepers = procs.spawn("keepers", Keeper, "t")
        pids = list(keepers.pid.call().get(timeout=30).values())
        retried = keepers.slow_retried.call(1)
        mark.write_text("")
        _kill(pids[1])
        event = procs.wait_restart(timeout=60)
        assert (event.kind, event.ranks) == ("failed", (1,)), event
        assert "this host refuses new ranks" in event.error, event.error
        assert event.line().startswith("[procs") and "not restarted: " in event.line()
        with pytest.raises(ProcessDied):
            retried.get(timeout=60)
    finally:
        procs.stop().get(timeout=30)
