"""``python -m benchmarks W9jump`` runs (issue 35's measure): calls on a host reached through a
login host with ``out_of_cluster=True``, beside a raw round trip over a forward of the same
ssh connection, and nothing is left on the simulated hosts (the job fails if anything is).
About 20 s; it skips unless root."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(300)


def test_w9jump_measures_calls_through_a_login_host_beside_the_ssh_hops_floor():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "W9jump"], cwd=ROOT, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    if "W9jump_skipped" in out:
        pytest.skip(out["W9jump_skipped"])
    assert "W9jump_error" not in out, f"{out}\n{r.stderr[-6000:]}"
    figures = ("W9jump_call_one_us", "W9jump_call_n4_us", "W9jump_call_n2_us", "W9jump_floor_hop_rtt_us",
               "W9jump_floor_hop_rtt_beside_n4_us", "W9jump_raw_push_pull_L_R_us", "W9jump_raw_push_pull_L_R_curve_us",
               "W9jump_same_host_call_one_us", "W9jump_same_host_n4_us")
    for key in figures:
        assert 0 < out[key]["median"] <= out[key]["p99"], (key, out)
    floor = out["W9jump_floor_hop_rtt_us"]["median"]
    assert out["W9jump_call_one_over_hop_floor"] == round(out["W9jump_call_one_us"]["median"] / floor, 2)
    beside = out["W9jump_floor_hop_rtt_beside_n4_us"]["median"]
    assert out["W9jump_call_n4_over_hop_floor"] == round(out["W9jump_call_n4_us"]["median"] / beside, 2)
