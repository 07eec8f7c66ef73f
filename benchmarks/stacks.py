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
