"""The chaos run, short: ``python -m benchmarks chaos`` for 45 seconds at a fixed seed (faults
at random across two simulated hosts and a real kernel's mesh, during calls, cells, buffer
reads and DDP steps; benchmarks/chaos.py).  It must end with no hang, no kernel or
controller death, no lost line, no orphaned process or file, and every recovery answered.
It runs with the restart policy on (``--restart-policy``): the killed rank is replaced by
the runtime, with nobody asking.  The full ten-minute runs are a benchmark.  Seed 7 is the
one that first failed: a rank's answer raced another thread's ``import torch`` and its
failure report failed too, so the call hung (test_envelope and test_bad_input pin both
fixes); on an idle 2-core machine it injects every kind once.  The run takes about a minute
in all here (setup, the last recovery and the checks included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 7

pytestmark = pytest.mark.timeout(900)


def _chaos(seed: int, minutes: float, *more: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks", "chaos", "--seed", str(seed), "--minutes", str(minutes),
                        *more], cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    if "chaos_skipped" in out:
        pytest.skip(out["chaos_skipped"])
    assert "chaos" in out, f"{out}\n{r.stderr[-6000:]}"
    return out["chaos"]


def test_45_seconds_of_faults_leave_every_call_answered_and_nothing_behind():  # skips unless root
    # with the restart policy on: a killed rank is replaced by the runtime, never by the run
    got = _chaos(SEED, 0.75, "--restart-policy")
    summary = {k: got[k] for k in ("faults", "calls_made", "calls_resolved", "hangs", "hang_list", "kernel_deaths",
                                   "lines_lost", "lines_duplicated", "lines_out_of_order", "orphans", "recovery",
                                   "kernel_restarts", "kernel_restarts_answered", "wrong_values")}
    assert got["faults_total"] >= 3, summary
    assert got["hangs"] == 0 and got["kernel_deaths"] == 0, summary
    assert got["lines_lost"] == got["lines_duplicated"] == got["lines_out_of_order"] == 0, summary
    assert got["orphans"]["processes"] == 0 and got["orphans"]["files"] == 0, summary
    assert got["recovery"]["failed_after"] == 0 and got["recovery"]["ddp_failed_after"] == 0, summary
    assert got["kernel_restarts_answered"] == got["kernel_restarts"], summary
    assert got["wrong_values"] == 0, summary
    assert got["calls_made"] > 100 and got["lines_seen"] > 0, summary
    assert got["restart_policy"] and got["recovery"]["by_policy"] + got["kernel_restarts_answered"] >= 1, summary
    assert got["ok"], summary
