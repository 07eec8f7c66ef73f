"""``python -m benchmarks gpu`` (``make gpu-check``) on a machine without a GPU: it says so
in its one JSON object, runs its shm part, and exits 0 (issue 46).  With a GPU the command
itself is the check, and this test leaves it to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.gpus import devices_here

from monarch_kernel.runtime.wire import native

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(devices_here() > 0, reason="with a GPU, `python -m benchmarks gpu` runs the whole check")
def test_without_a_gpu_the_check_says_so_runs_its_shm_part_and_exits_0():
    p = subprocess.run([sys.executable, "-m", "benchmarks", "gpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=290, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["gpu"] is False
    assert out["no_gpu"].startswith("no GPU here (") and "the shm part ran alone" in out["no_gpu"]
    assert "no GPU here" in p.stderr
    shm = out["shm"]["64 MiB"]
    assert shm["transport"] == "shm" and shm["read_ms"] > 0 and shm["copy_ms"] > 0
    assert "cuda_tests" not in out and out["meta"]["workloads"] == ["gpu"]
    built, why = native.is_available()  # which wire ran: a tree without the C one measures the pure-Python one
    assert out["meta"]["wire"] == ("C" if built else f"pure Python: {why}")
