"""Calls as the caller sees them: a rank killed mid-call fails only its own part of the
answer (streams included), a dead interior node of the forwarding tree is repaired around,
the tree arithmetic the caller uses for that repair agrees with how ranks forward, and a
call to many ranks costs the controller only its fanout in messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from support.actors import Echo, alive, wait_for
from support.scripts import run_script, write_script

from monarch_kernel import ProcessDied, this_host
from monarch_kernel.runtime.calls.tree import NodeTable, children, locate, split, split_groups
from monarch_kernel.runtime.wire.envelope import Part


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
from support.actors import Echo, wait_for

def outcome(fut):
    try:
        return {"values": list(fut.get(timeout=15).values())}
    except ProcessDied as e:
        return {"died": e.rank, "signal": e.signal,
                "values": [type(v).__name__ if isinstance(v, BaseException) else v for v in e.results.values()]}
    except TimeoutError:
        return {"timeout": True}

marker = sys.argv[1]
assert Runtime.current().outbox.fanout == 2
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


# ---------------------------------------------------------------- the tree the caller repairs


@pytest.mark.timeout(30)
def test_split_covers_every_rank_once():
    for n in range(0, 70):
        for fanout in (1, 2, 3, 8):
            seen = []

            def walk(sub, seen=seen, fanout=fanout):
                seen.append(sub[0])
                for c in children(sub, fanout):
                    walk(c)

            roots = split(list(range(n)), fanout)
            assert len(roots) <= fanout
            for sub in roots:
                walk(sub)
            assert sorted(seen) == list(range(n))


@pytest.mark.timeout(30)
def test_locate_matches_forwarding():
    ranks = list(range(16))
    parent, sub = locate(ranks, 2, 0)
    assert parent is None and sub == list(range(8))
    parent, sub = locate(ranks, 2, 1)
    assert parent == 0 and sub[0] == 1
    assert locate(ranks, 2, 99) is None
    for r in ranks:
        parent, sub = locate(ranks, 2, r)
        if parent is not None:
            assert any(c[0] == r for c in children(locate(ranks, 2, parent)[1], 2))


@pytest.mark.timeout(30)
def test_split_groups_keeps_each_hosts_ranks_in_one_subtree_and_locate_follows_it():
    """An out-of-cluster host's ranks (one group) are one subtree: the caller sends its ssh
    connection one message, and the tree below that root is the usual one."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    assert split_groups(groups, 8) == [[0, 1, 2, 3], [4, 5, 6, 7], [8], [9]]
    top = split_groups(groups, 2)
    assert top == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]
    ranks = list(range(10))
    assert locate(ranks, 2, 8, top) == (None, [8, 9])
    assert locate(ranks, 2, 9, top) == (8, [9])
    assert locate(ranks, 2, 8) != (None, [8, 9])  # without ``top``: split's own first level
    for r in ranks:
        parent, sub = locate(ranks, 2, r, top)
        if parent is not None:
            assert any(c[0] == r for c in children(locate(ranks, 2, parent, top)[1], 2))


@pytest.mark.timeout(30)
def test_node_table_redirect_outcomes():
    t = NodeTable()
    key = ("origin", 1)
    assert t.start(key, "parent", True, {0, 5}, False)
    assert not t.start(key, "parent", True, {0}, False)  # a call runs once
    assert t.add(key, 0, [Part(0, 0, [b""])]) is None
    assert t.redirect(key, "origin") == "active"
    st = t.add(key, 5, [Part(5, 0, [b""])])
    assert st.reply_to == "origin" and not st.to_node and len(st.parts) == 2

    key2 = ("origin", 2)
    t.start(key2, "parent", True, {0}, False)
    t.add(key2, 0, [Part(0, 0, [b""])])
    kind, parts = t.redirect(key2, "origin")  # already sent to the dead parent: resend
    assert kind == "resend" and len(parts) == 1

    key3 = ("origin", 3)
    assert t.redirect(key3, "origin") == "lost"
    assert not t.start(key3, "parent", True, {0}, False)  # the late original is refused
    assert t.start(key3, "origin", False, {0}, True)  # the caller's resend runs

    key4 = ("origin", 4)
    t.start(key4, "parent", True, {0, 2}, False)
    st = t.prune(key4, 2)
    assert st is None
    assert t.add(key4, 0, [Part(0, 0, [b""])]).reply_to == "parent"


# ---------------------------------------------------------------- what a call costs the controller


@pytest.mark.timeout(60)
def test_fanout_keeps_controller_messages_constant(tmp_path):
    """A call to 16 ranks with fanout 4 costs the controller 4 sends and 4 receives."""
    script = tmp_path / "fanout.py"
    script.write_text(textwrap.dedent('''
        from monarch_kernel import Actor, endpoint, this_host
        from monarch_kernel.runtime.process import Runtime

        class E(Actor):
            @endpoint
            def echo(self, x):
                return x

        procs = this_host().spawn_procs(per_host={"gpus": 16})
        m = procs.spawn("e", E)
        rt = Runtime.current()
        m.initialized().get(timeout=30)  # the spawn's own answers are all in (they may trail the first call's)
        m.echo.call(0).get()
        s, r = rt.transport.sent, rt.receiver.received
        for i in range(10):
            assert list(m.echo.call(i).get(timeout=30).values()) == [i] * 16
        print("per call", (rt.transport.sent - s) / 10, (rt.receiver.received - r) / 10)
        procs.stop().get()
    '''))
    for fanout, expect in (("4", "per call 4.0 4.0"), ("2", "per call 2.0 2.0")):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                             env={**os.environ, "MONARCH_KERNEL_FANOUT": fanout})
        assert out.returncode == 0, out.stderr
        assert expect in out.stdout
