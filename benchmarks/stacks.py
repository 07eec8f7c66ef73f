"""W14, stacks part: the time from ``procs.stacks()`` (what ``%mesh stacks`` and the panel's
Stacks button call) to the grouped report, at 8, 64 and 256 ranks on this host, with one
rank busy in an endpoint so that the report has two groups: the default (each rank's own
dump) five times, then once with py-spy reading every rank from its template.  Sizes come
from MONARCH_KERNEL_STACKS_SIZES (default 8,64,256).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from ._util import log, spawn_bench


def _sizes() -> list[int]:
    return [int(s) for s in os.environ.get("MONARCH_KERNEL_STACKS_SIZES", "8,64,256").split(",") if s]


def w14_stacks() -> dict:
    out: dict = {}
    for n in _sizes():
        procs, mesh = spawn_bench(n, f"stacks{n}")
        try:
            started = os.path.join(tempfile.mkdtemp(prefix="mkbench-stacks-"), "started")
            mesh.slice(gpus=n - 1).sleep.call_one(600, started)
            deadline = time.monotonic() + 60
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.05)
            times, groups, methods = [], 0, {}
            for _ in range(5):
                t = time.perf_counter()
                report = procs.stacks()
                times.append(time.perf_counter() - t)
                groups, methods = len(report.groups), {m: len(r) for m, r in report.methods().items()}
            t = time.perf_counter()
            outside = procs.stacks(method="py-spy")  # every rank read by py-spy, from its template
            spy_s = time.perf_counter() - t
            out[f"n{n}"] = {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                            "groups": groups, "methods": methods, "py_spy_all_s": round(spy_s, 3),
                            "py_spy_groups": len(outside.groups)}
            log(f"W14 stacks n={n}: {out[f'n{n}']}")
        finally:
            procs.stop().get(timeout=120)
    return {"W14_stacks": out}


def w14_recorder() -> dict:
    """The collectives flight recorder's cost on W10's DDP step: the same script on two warm
    4-rank meshes, one with torch's recorder off (TORCH_FR_BUFFER_SIZE=0 on its ranks), one
    with it on (setup's default), runs interleaved; and the profiler's cost: the same run
    inside ``spmd.profile`` on the second mesh.  Medians of the step times."""
    from monarch_kernel import this_host
    from monarch_kernel.spmd import SPMDActor

    from .training import SCRIPT, N, _mesh_run, _step_ms

    tmp = tempfile.mkdtemp(prefix="mk-w14-")
    script = os.path.join(tmp, "train_ddp.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    args = ["--steps", "220", "--warmup", "20"]
    off = this_host().spawn_procs(per_host={"gpus": N}, env={"TORCH_FR_BUFFER_SIZE": "0"})
    on = this_host().spawn_procs(per_host={"gpus": N})
    steps: dict[str, list[float]] = {"off": [], "on": [], "profiled": []}
    try:
        actors = {"off": off.spawn("spmd", SPMDActor), "on": on.spawn("spmd", SPMDActor)}
        meshes = {"off": off, "on": on}
        from monarch_kernel.spmd import profile

        for i in range(3):
            for kind in ("off", "on"):
                rows, _ = _mesh_run(meshes[kind], actors[kind], script, args, tmp, f"{kind}-{i}")
                steps[kind].append(_step_ms(rows))
            with profile(on, os.path.join(tmp, f"trace-{i}.json")):  # torch.profiler on every rank
                rows, _ = _mesh_run(on, actors["on"], script, args, tmp, f"profiled-{i}")
            steps["profiled"].append(_step_ms(rows))
    finally:
        off.stop().get(timeout=60)
        on.stop().get(timeout=60)
    a, b = statistics.median(steps["off"]), statistics.median(steps["on"])
    c = statistics.median(steps["profiled"])
    out = {"step_ms_off": round(a, 3), "step_ms_on": round(b, 3), "overhead_pct": round(100 * (b - a) / a, 1),
           "step_ms_profiled": round(c, 3), "profiler_overhead_pct": round(100 * (c - b) / b, 1), "runs": steps}
    log(f"W14 recorder: {out}")
    return {"W14_recorder": out}
