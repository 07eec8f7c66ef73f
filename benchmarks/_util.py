"""Shared helpers: logging to stderr, latency summaries, and spawning benchmark meshes.

Latencies are summarised as median and p99 (nearest-rank) of the timed samples.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*args) -> None:
    print("[bench]", *args, file=sys.stderr, flush=True)


def p99(samples) -> float:
    xs = sorted(samples)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


def summary_us(samples_s) -> dict:
    """Median and p99 of samples given in seconds, in microseconds."""
    return {"median": round(statistics.median(samples_s) * 1e6, 1), "p99": round(p99(samples_s) * 1e6, 1)}


def time_calls(fn, warmup: int, timed: int) -> list[float]:
    """Call ``fn(i)`` ``warmup`` times untimed, then ``timed`` times; per-call seconds."""
    for i in range(warmup):
        fn(i)
    out = []
    pc = time.perf_counter
    for i in range(timed):
        t0 = pc()
        fn(i)
        out.append(pc() - t0)
    return out


def spawn_bench(n: int, name: str = "bench"):
    """A proc mesh of ``n`` ranks ({"gpus": n}) and a ``Bench`` actor mesh on it."""
    from monarch_kernel import this_host

    from ._actors import Bench

    procs = this_host().spawn_procs(per_host={"gpus": n})
    try:
        mesh = procs.spawn(name, Bench)
    except BaseException:
        procs.stop().get(timeout=30)
        raise
    return procs, mesh


def kill_group(proc: subprocess.Popen) -> None:
    """End a child started with ``start_new_session=True`` and everything in its group."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
