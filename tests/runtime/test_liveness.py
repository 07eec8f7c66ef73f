"""Frozen and blocked ranks: heartbeats show a rank that stopped answering, and a rank's
subprocesses end with it.  (Interrupts cutting a blocking call short: test_server.py.)"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from support.actors import wait_until as _wait
from support.config import configured
from support.freeze import freeze

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.console.console import Console
from monarch_kernel.runtime.errors import ActorError, ProcessDied

pytestmark = pytest.mark.timeout(90)


class Spawner(Actor):
    @endpoint
    def start(self) -> list[int]:
        import subprocess

        plain = subprocess.Popen(["sleep", "300"])
        own_session = subprocess.Popen(["setsid", "sleep", "301"])
        # A grandchild whose parent exits at once, in a session of its own.
        sh = subprocess.Popen(["sh", "-c", "setsid sleep 302 & echo $!"], stdout=subprocess.PIPE, text=True)
        orphan = int(sh.stdout.readline())
        sh.wait()
        return [plain.pid, own_session.pid, orphan]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_ranks_subprocesses_end_with_it(how):
    # Before: all three survived %mesh stop, reparented to PID 1.
    procs = this_host().spawn_procs(per_host={"r": 1})
    try:
        pids = procs.spawn("spawner", Spawner).start.call_one().get(timeout=20)
        assert all(_alive(p) for p in pids)
        if how == "kill":
            rank_pid = procs._owned.pids[0]
            os.kill(rank_pid, signal.SIGKILL)
            _wait(lambda: not _alive(rank_pid), 10, "the killed rank to exit")
    finally:
        procs.stop().get(timeout=20)
    _wait(lambda: not any(_alive(p) for p in pids), 5, f"the rank's subprocesses {pids} to end")


def test_a_frozen_rank_is_shown_not_responding():
    from monarch_kernel.kernel import status

    with configured(heartbeat_timeout=1.5), this_host().spawn_procs(per_host={"r": 2}) as procs:
        consoles = procs.spawn("console", Console)
        pid = procs._owned.pids[1]
        freeze(pid)
        try:
            def states():
                return [row["state"] for row in status.snapshot(procs, {})]

            _wait(lambda: states()[1].startswith("not responding"), 10, "rank 1 to be shown not responding")
            assert states()[0] == "idle"
            pending = consoles.slice(r=1).pull.call_one("x")
            # What %mesh restart does to such a rank: kill it, failing what waits on it.
            from monarch_kernel.runtime.process import Runtime

            for c in Runtime.current().launcher.kill(procs._owned, [1]):
                assert c.wait(10)
            with pytest.raises(ProcessDied):
                pending.get(timeout=5)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_restart_kills_and_replaces_a_rank_that_stopped_responding():
    """``ProcMesh.restart()``, the one restart path (the magic and the panel call it): with no
    ranks named it takes the dead ranks and the ones not responding, killing those first;
    a live rank that responds is refused."""
    with configured(heartbeat_timeout=1.5), this_host().spawn_procs(per_host={"r": 3}) as procs:
        consoles = procs.spawn("console", Console)
        consoles.initialized().get(timeout=30)
        frozen = procs._owned.pids[1]
        with pytest.raises(ActorError):
            consoles.slice(r=2).run.call_one("import os; os._exit(3)", "<t>", "c").get(timeout=10)
        freeze(frozen)
        try:
            _wait(lambda: procs.rank_states()[1]["state"] == "not responding", 10, "rank 1 to be shown not responding")
            with pytest.raises(ValueError, match=r"ranks \[0\] of mesh '.*' are alive; restart replaces dead ranks "
                                                 r"\(\[2\]\) and ones not responding \(\[1\]\) only"):
                procs.restart([0, 1])
            done = procs.restart(actors=[(consoles, Console, (), {})])
            assert (done.ranks, done.killed) == ([1, 2], [1])
            assert [row["state"] for row in procs.rank_states()] == ["idle"] * 3
            assert procs._owned.pids[1] != frozen and not _alive(frozen)
            value = consoles.run.call("1 + 1", "<t>", "c").get(timeout=10)
            assert [v["value"] for v in value.values()] == ["2"] * 3
            assert procs.restart() == ([], [])
        finally:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
