"""W5: milliseconds from a rank's death to the caller's ``ProcessDied`` while a call to it
is pending: (a) the endpoint calls ``os._exit(1)`` (death = its time.time() just before),
(b) the controller SIGKILLs the rank during a ``sleep(30)`` call (death = just before
os.kill).  Median of 5 fresh 4-rank meshes each; then the other 3 ranks must still answer.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time

from ._util import log, spawn_bench

RUNS = 5
N = 4
VICTIM = 1


def _others_answer(mesh) -> bool:
    try:
        return all(mesh.slice(gpus=r).echo.call_one(r).get(timeout=10) == r
                   for r in range(N) if r != VICTIM)
    except Exception as e:
        log(f"W5: another rank failed to answer: {e!r}")
        return False


def _one(kind: str, tmp: str, i: int) -> tuple[float | None, bool, str | None]:
    from monarch_kernel import ProcessDied

    procs, mesh = spawn_bench(N, name=f"w5{kind}{i}")
    victim = mesh.slice(gpus=VICTIM)
    err = None
    ms = None
    try:
        pid = victim.pid.call_one().get(timeout=10)
        if kind == "exit":
            stamp = os.path.join(tmp, f"exit{i}")
            fut = victim.exit_now.call_one(stamp)
            try:
                fut.get(timeout=30)
                err = "exit_now returned"
            except ProcessDied:
                t_exc = time.time()
                with open(stamp) as f:
                    ms = (t_exc - float(f.read())) * 1e3
        else:
            started = os.path.join(tmp, f"started{i}")
            fut = victim.sleep.call_one(30.0, started)
            deadline = time.monotonic() + 10
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.01)
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            try:
                fut.get(timeout=30)
                err = "sleep returned"
            except ProcessDied:
                ms = (time.perf_counter() - t_kill) * 1e3
        others = _others_answer(mesh)
    except Exception as e:  # a wrong exception type (or a timeout) is a result too
        err, others = f"{type(e).__name__}: {e}", _others_answer(mesh)
    finally:
        procs.stop().get(timeout=30)
    return ms, others, err


def w5() -> dict:
    tmp = tempfile.mkdtemp(prefix="mkbench-w5-")
    out: dict = {}
    others_all = True
    errors = []
    try:
        for kind in ("exit", "sigkill"):
            samples = []
            for i in range(RUNS):
                ms, others, err = _one(kind, tmp, i)
                log(f"W5 {kind} run {i}: {ms if ms is None else round(ms, 2)} ms, others answer: {others}"
                    + (f", error: {err}" if err else ""))
                others_all = others_all and others
                if err:
                    errors.append(f"{kind}#{i}: {err}")
                if ms is not None:
                    samples.append(ms)
            out[kind] = round(statistics.median(samples), 2) if samples else None
            out[f"{kind}_max"] = round(max(samples), 2) if samples else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["others_answer"] = others_all
    res = {"W5_death_to_exception_ms": out}
    if errors:
        res["W5_errors"] = errors
    return res
