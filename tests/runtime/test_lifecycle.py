"""Process lifecycle: ranks killed or exiting mid-call, and rank output.  (Spawn, stop and
restart, and the controller going away: test_launcher.py; supervision: test_supervision.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
from _actors import Echo, alive, wait_for  # noqa: I001
from _scripts import run_script, write_script

from monarch_kernel import ProcessDied, this_host
from monarch_kernel.runtime.process import Runtime


def results_summary(vm) -> list:
    return [type(v).__name__ if isinstance(v, BaseException) else v for v in vm.values()]



# ---------------------------------------------------------------- ranks dying mid-call


@pytest.mark.timeout(60)
def test_sigkill_rank_mid_call(tmp_path):
    with this_host().spawn_procs(per_host={"gpus": 4}, name="victims") as procs:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        fut = m.nap.call(6, str(tmp_path))
        assert wait_for(lambda: all((tmp_path / f"started.{r}").exists() for r in range(4)), 20)
        os.kill(pids[2], signal.SIGKILL)

        # The other ranks answer other calls while the nap runs.
        assert list(m.slice(gpus=slice(0, 2)).echo.call("a").get(timeout=20).values()) == ["a", "a"]
        assert m.slice(gpus=3).echo.call_one("b").get(timeout=20) == "b"

        with pytest.raises(ProcessDied) as info:
            fut.get(timeout=30)
        err = info.value
        assert (err.rank, err.signal, err.exitcode, err.pid) == (2, 9, None, pids[2])
        assert f"rank 2 of mesh 'victims' (pid {pids[2]} on {err.host}) killed by signal 9 (SIGKILL)" in str(err)
        assert results_summary(err.results) == [0, 1, "ProcessDied", 3]
        assert err.results[2] is err

        # Later calls: the slice without rank 2 works; the whole mesh reports rank 2 at once.
        assert list(m.slice(gpus=slice(0, 2)).echo.call("c").get(timeout=20).values()) == ["c", "c"]
        with pytest.raises(ProcessDied, match="rank 2 of mesh 'victims'") as info:
            m.echo.call("d").get(timeout=20)
        assert results_summary(info.value.results) == ["d", "d", "ProcessDied", "d"]
    assert alive(pids) == []


@pytest.mark.timeout(60)
def test_stream_reports_killed_rank_while_others_still_run(tmp_path):
    with this_host().spawn_procs(per_host={"gpus": 4}, name="victims") as procs:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())

        def killer():
            if wait_for(lambda: all((tmp_path / f"started.{r}").exists() for r in range(4)), 20):
                os.kill(pids[2], signal.SIGKILL)

        t = threading.Thread(target=killer)
        t.start()
        try:
            # The naps outlast the test's timeout: only the dead rank can answer first.
            first = next(iter(m.nap.stream(600, str(tmp_path))))
        finally:
            t.join(30)
        with pytest.raises(ProcessDied, match="rank 2 of mesh 'victims'"):
            first.get(timeout=1)


FANOUT_SCRIPT = """
import json, os, sys, time
from monarch_kernel import ProcessDied, this_host
from monarch_kernel.runtime.process import Runtime
from _actors import Echo, wait_for

def outcome(fut):
    try:
        return {"values": list(fut.get(timeout=15).values())}
    except ProcessDied as e:
        return {"died": e.rank, "signal": e.signal,
                "values": [type(v).__name__ if isinstance(v, BaseException) else v for v in e.results.values()]}
    except TimeoutError:
        return {"timeout": True}

marker = sys.argv[1]
assert Runtime.current().caller.fanout == 2
procs = this_host().spawn_procs(per_host={"gpus": 16}, name="tree")
try:
    m = procs.spawn("echo", Echo)
    pids = list(m.pid.call().get(timeout=30).values())
    out = {}

    # Rank 1 forwards to ranks 2..4; kill it while its whole subtree is still running.
    os.mkdir(marker + "/a")
    fut = m.nap.call(4, marker + "/a")
    assert wait_for(lambda: len(os.listdir(marker + "/a")) == 16, 20), \
        "timed out after 20 s waiting for all 16 ranks to start their nap"
    os.kill(pids[1], 9)
    out["a"] = outcome(fut)

    # With rank 1 gone the tree is built over the 15 live ranks: rank 9 roots the
    # subtree 9..15 and forwards to ranks 10 and 13.  They answer at once and rank 9
    # holds their answers while it naps; then it is killed.
    os.mkdir(marker + "/b")
    fut = m.nap_on.call(9, 600, marker + "/b")
    assert wait_for(lambda: os.path.exists(marker + "/b/held.9"), 30), \
        "timed out after 30 s waiting for rank 9 to hold the answers of ranks 10..15"
    os.kill(pids[9], 9)
    out["b"] = outcome(fut)

    out["after"] = outcome(m.echo.call("x"))
    print("RESULT " + json.dumps(out), flush=True)
finally:
    procs.stop().get(timeout=20)
"""


@pytest.mark.timeout(90)
def test_sigkill_interior_tree_node_mid_call(tmp_path):
    """16 ranks, fanout 2: ranks 1 and 9 forward the call to others.  Killing one fails
    only that rank; the ranks below it still answer, within the timeout."""
    path = write_script(tmp_path, "tree.py", FANOUT_SCRIPT)
    out = run_script(path, str(tmp_path), env={"MONARCH_KERNEL_FANOUT": "2"}, timeout=80)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    res = json.loads(line.removeprefix("RESULT "))
    expect_a = list(range(16))
    expect_a[1] = "ProcessDied"
    assert res["a"] == {"died": 1, "signal": 9, "values": expect_a}, out.stderr
    expect_b = list(range(16))
    expect_b[1] = expect_b[9] = "ProcessDied"
    assert res["b"] == {"died": 1, "signal": 9, "values": expect_b}, out.stderr
    expect_after = ["x"] * 16
    expect_after[1] = expect_after[9] = "ProcessDied"
    assert res["after"] == {"died": 1, "signal": 9, "values": expect_after}


@pytest.mark.timeout(60)
def test_os_exit_in_endpoint_reports_exit_code_and_stderr():
    with this_host().spawn_procs(per_host={"gpus": 2}, name="exiters") as procs:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        with pytest.raises(ProcessDied) as info:
            m.slice(gpus=1).exit_with.call_one(3, "about to exit: goodbye").get(timeout=30)
        err = info.value
        assert (err.rank, err.exitcode, err.signal, err.pid) == (1, 3, None, pids[1])
        assert err.stderr_tail[-1] == "about to exit: goodbye"
        assert str(err).startswith(f"rank 1 of mesh 'exiters' (pid {pids[1]} on {err.host}) exited with code 3\n")
        assert str(err).endswith("last lines of its stderr:\n    about to exit: goodbye")
        assert err.method == "exit_with"
        assert m.slice(gpus=0).echo.call_one("still here").get(timeout=20) == "still here"


# ---------------------------------------------------------------- rank output


LAST_WORDS = """
from monarch_kernel import Actor, current_rank, endpoint, this_host

class Shout(Actor):
    @endpoint
    def shout(self, n):
        for i in range(n):
            print(f"last {current_rank().rank} {i} " + "x" * 400, flush=True)

procs = this_host().spawn_procs(per_host={"r": 4})
shout = procs.spawn("shout", Shout)
shout.shout.call(1).get()
# A busy machine, made certain: the template that reads the ranks' pipes is frozen while
# they print, and thaws 0.3 s after the script has reached its end.
import os, signal, threading
from monarch_kernel.runtime.process import Runtime
template = next(iter(Runtime.current().launcher.templates.values())).proc.pid
os.kill(template, signal.SIGSTOP)
shout.shout.call(1500).get()
threading.Timer(0.3, os.kill, (template, signal.SIGCONT)).start()
"""  # and the script ends at once, its meshes still up


@pytest.mark.timeout(60)
def test_what_ranks_printed_before_the_controller_exits_is_shown(tmp_path):
    out = run_script(write_script(tmp_path, "last_words.py", LAST_WORDS))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if " last " in line]
    for r in range(4):
        mine = [line for line in lines if line.startswith(f"[rank {r}] last {r} ")]
        # about 0.6 MB each (a pipe holds it all), written just before the script ends: still in the ranks' pipes
        # (and the template's socket) when the controller reaches its exit
        want = [f"[rank {r}] last {r} 0 " + "x" * 400] + [f"[rank {r}] last {r} {i} " + "x" * 400 for i in range(1500)]
        assert mine == want, (r, len(mine), [line[:30] for line in mine[-2:]])


@pytest.mark.timeout(60)
def test_rank_output_is_forwarded_with_its_rank():
    rt = Runtime.current()
    lines: list[tuple] = []
    sink = rt.hooks.output.install(lambda mesh, rank, stream, line: lines.append((mesh, rank, stream, line)))
    try:
        with this_host().spawn_procs(per_host={"gpus": 2}, name="talkers") as procs:
            m = procs.spawn("echo", Echo)
            assert list(m.chatter.call("T1").get(timeout=30).values()) == [0, 1]
            expected = set()
            for r in range(2):
                expected |= {
                    ("talkers", r, "stdout", f"T1 print from rank {r}"),
                    ("talkers", r, "stderr", f"T1 stderr from rank {r}"),
                    ("talkers", r, "stdout", f"T1 os.write from rank {r}"),
                    ("talkers", r, "stdout", f"T1 child process of rank {r}"),
                }
            wait_for(lambda: expected <= set(lines), 20)
            assert sorted(expected - set(lines)) == []
            # Per rank and stream, lines arrive in the order they were written.
            rank0 = [line for (_, r, s, line) in list(lines) if r == 0 and s == "stdout" and line.startswith("T1")]
            assert rank0 == ["T1 print from rank 0", "T1 os.write from rank 0", "T1 child process of rank 0"]
    finally:
        sink.remove()
