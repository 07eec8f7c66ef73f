"""W1: seconds from a fresh controller process to an N-rank mesh that answered a no-op
(N=4, 8; median of 3 new processes), timed inside the child from its first statement and
by the parent around the child.  W6: resident memory (RSS, USS) of an idle rank and of the
controller after the same start-up with N=4.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

from ._util import ROOT, kill_group, log

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_spawn_child.py")
RUNS = 3


def _run_child(n: int, *extra: str, timeout: float = 90) -> dict:
    """One fresh controller; returns its own timings plus the parent's view."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, CHILD, str(n), *extra], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=sys.stderr, text=True, start_new_session=True)
    t_ready, result = None, None
    watchdog = threading.Timer(timeout, kill_group, args=(p,))  # a hung child is killed
    watchdog.start()
    try:
        for line in p.stdout:
            if line.startswith("READY") and t_ready is None:
                t_ready = time.perf_counter()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            else:
                sys.stderr.write(line)
        rc = p.wait()
    except BaseException:
        kill_group(p)
        raise
    finally:
        watchdog.cancel()
    t_end = time.perf_counter()
    if rc != 0 or result is None or t_ready is None:
        raise RuntimeError(f"spawn child (n={n}) failed: rc={rc}, result={result}")
    result["parent_to_answer_s"] = t_ready - t0
    result["parent_total_s"] = t_end - t0
    return result


def w1() -> dict:
    inside, to_answer, total = {}, {}, {}
    for n in (4, 8):
        runs = []
        for i in range(RUNS):
            r = _run_child(n)
            log(f"W1 n={n} run {i}: {r['spawn_s']:.3f} s inside, {r['parent_to_answer_s']:.3f} s parent-to-answer")
            runs.append(r)
        key = f"n{n}"
        inside[key] = round(statistics.median(r["spawn_s"] for r in runs), 4)
        to_answer[key] = round(statistics.median(r["parent_to_answer_s"] for r in runs), 4)
        total[key] = round(statistics.median(r["parent_total_s"] for r in runs), 4)
    return {
        "W1_spawn_s": inside,
        "W1_spawn_parent_wall_s": {"to_answer": to_answer, "total_incl_stop_and_exit": total},
        "W1_note": "W1_spawn_s: child's time.perf_counter() from its first statement (before importing "
                   "monarch_kernel) to the no-op answer; parent wall: Popen to the child's READY line "
                   "(includes interpreter start), and to the child's exit (adds stop + exit)",
    }


def w6() -> dict:
    r = _run_child(4, "--rss")
    keys = ("rank", "rank_uss", "rank_pss", "controller", "template")
    out = {k: (round(r[k], 1) if isinstance(r.get(k), (int, float)) else r.get(k)) for k in keys if k in r}
    if "rank_uss_error" in r:
        out["rank_uss_error"] = r["rank_uss_error"]
    log(f"W6: {out}")
    return {"W6_rss_mib": out}
