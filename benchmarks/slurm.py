"""W1 over Slurm: a ``SlurmJob`` of 2 nodes x 2 ranks, from ``job.state()`` to the first
answer of all four, with the scheduling delay (sbatch to RUNNING, the queue's share) reported
apart and subtracted; median of 3 allocations in this process (the first also starts the
controller's network listener).  Runs on the tests' simulated cluster (tests/support/cluster.py:
slurmctld and one slurmd per network namespace, Slurm 22.05); without root or Slurm's
daemons it reports why it did not run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from ._util import ROOT, log

RUNS = 3


def _one(nodes: int) -> dict:
    from monarch_kernel.job import SlurmJob

    from ._actors import Bench

    t0 = time.perf_counter()
    job = SlurmJob(meshes={"w": nodes})
    try:
        state = job.state()
        t_agents = time.perf_counter()
        mesh = state.w.spawn_procs(per_host={"gpus": 2}).spawn("b", Bench)
        mesh.echo.call(0).get(timeout=60)
        t_answer = time.perf_counter()
    finally:
        t_kill = time.perf_counter()
        job.kill()
    delay = job.scheduling_delay_s or 0.0
    return {"scheduling_s": delay, "agents_up_s": t_agents - t0 - delay, "spawn_to_answer_s": t_answer - t_agents,
            "first_answer_s": t_answer - t0 - delay, "kill_s": time.perf_counter() - t_kill}


def w1_slurm() -> dict:
    if os.geteuid() != 0:
        return {"W1slurm_skipped": "needs root: network namespaces and Slurm's daemons simulate the nodes"}
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import pytest
    from support import cluster  # the tests' simulated hosts

    runs = []
    try:
        with cluster.slurm_network() as c:
            os.environ["SLURM_CONF"] = c.conf
            for i in range(RUNS):
                r = _one(len(c.nodes))
                log(f"W1slurm run {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
                runs.append(r)
    except pytest.skip.Exception as e:  # a daemon or client is not installed
        return {"W1slurm_skipped": str(e)}
    out = {f"W1slurm_2x2_{k}": {"median": round(statistics.median(r[k] for r in runs), 3),
                                "first": round(runs[0][k], 3)} for k in runs[0]}
    out["W1slurm_note"] = ("first_answer_s: job.state() to all 4 ranks' first answer, less scheduling_s (sbatch "
                           "to squeue's RUNNING, polled every 0.1-0.25 s); agents_up_s: the srun steps' agents "
                           "connected; kill_s: agents ended, scancel, and squeue no longer lists the job")
    log(f"W1slurm: {out}")
    return out
