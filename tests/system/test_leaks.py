"""Long sessions: short-lived calling threads and spawn/stop churn leave the controller's
descriptors and run-directory entries flat, and a send that cannot go fails the call at
once instead of leaving it to time out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from support.actors import Echo

from monarch_kernel import this_host
from monarch_kernel.runtime.errors import SendFailed
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(120)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _entries() -> int:
    return len(os.listdir(Runtime.current().rundir))


def test_short_lived_calling_threads_leave_descriptors_flat():
    # Before: 3 descriptors and one ipc file per thread, and past ~1,020 threads calls were
    # never sent (ZeroMQ's socket limit) and hung until their timeout.
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        echo = procs.spawn("echo", Echo)
        errors = []

        def one(i):
            try:
                assert echo.echo.call_one(i).get(timeout=10) == i
            except BaseException as e:  # reported below, with the thread's number
                errors.append((i, e))

        for i in range(50):  # warm-up: sockets that exist once per process
            t = threading.Thread(target=one, args=(i,))
            t.start()
            t.join()
        fds, entries = _fds(), _entries()
        for i in range(1500):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            t.join(timeout=15)
            assert not t.is_alive(), f"thread {i}'s call hung"
        assert not errors, errors[:3]
        # A busy machine may free a thread's locals after the next thread has started, so a
        # few inboxes more may exist: the count follows threads alive at once, not threads made.
        assert _fds() - fds <= 60, f"{_fds() - fds} descriptors more after 1,500 threads"
        assert _entries() - entries <= 20
        assert echo.echo.call_one("main").get(timeout=10) == "main"


def test_spawn_stop_churn_leaves_descriptors_and_run_directory_flat():
    # Before: about 12 descriptors and 8 ipc files per cycle; at cycle ~86 spawn hung.
    counts = []
    for i in range(40):
        procs = this_host().spawn_procs(per_host={"r": 4}, timeout=30)
        echo = procs.spawn("echo", Echo)
        assert list(echo.echo.call(i).get(timeout=10).values()) == [i] * 4
        procs.stop().get(timeout=10)
        counts.append((_fds(), _entries()))
    (fds0, ent0), (fds1, ent1) = counts[2], counts[-1]
    assert fds1 - fds0 <= 3, f"descriptors went {fds0} -> {fds1} over {len(counts) - 3} cycles"
    assert ent1 - ent0 <= 1, f"run-directory entries went {ent0} -> {ent1}"


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    import psutil
    from support.actors import Echo
    from monarch_kernel import this_host
    from monarch_kernel.runtime.errors import SendFailed
    procs = this_host().spawn_procs(per_host={"r": 2})
    echo = procs.spawn("echo", Echo)
    pid = echo.slice(r=1).pid.call_one().get(timeout=10)
    os.kill(pid, signal.SIGSTOP)          # rank 1 stops reading; rank 0 still answers
    rss0 = psutil.Process().memory_info().rss
    payload = b"x" * (100 << 10)
    futs, failed, t0 = [], None, time.monotonic()
    for i in range(4000):
        fut = echo.slice(r=1).echo.call_one(payload)
        if fut.done():
            try:
                fut.get()
            except SendFailed as e:
                failed = {"after": i, "message": str(e), "s": time.monotonic() - t0}
                break
        futs.append(fut)
    grown = (psutil.Process().memory_info().rss - rss0) / 2**20
    other = echo.slice(r=0).echo.call_one(7).get(timeout=10)
    t1 = time.monotonic()
    procs.stop()                          # fails what is still queued for the frozen rank
    try:
        futs[-1].get(timeout=10)
        pending = "answered"
    except Exception as e:
        pending = type(e).__name__
    print(json.dumps({"failed": failed, "grown_mib": grown, "other": other,
                      "pending": pending, "stop_s": time.monotonic() - t1}))
""")


def test_a_frozen_rank_fills_a_bounded_queue_and_the_sender_hears_why(tmp_path):
    # Before: 2,000 queued 100 KiB calls grew the controller without limit and nothing failed.
    script = tmp_path / "frozen.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, MONARCH_KERNEL_SEND_QUEUE="200", MONARCH_KERNEL_SEND_BLOCK="0.5")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the script imports support.actors
    r = subprocess.run([sys.executable, str(script), tests], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["failed"] is not None, "no send ever failed"
    assert out["failed"]["after"] < 2000
    assert "messages are already queued" in out["failed"]["message"]
    assert "MONARCH_KERNEL_SEND_QUEUE" in out["failed"]["message"]
    assert out["grown_mib"] < 150
    assert out["other"] == 7
    assert out["pending"] in ("ProcessDied", "MeshStopped")
    assert out["stop_s"] < 10


def test_send_failed_is_a_connection_error():
    assert issubclass(SendFailed, ConnectionError)
