"""W11 (``make bench-scale``, not in the default ``make bench``): W8 at 256, 512 and 1,024
ranks on this host.  Per size: spawn time; a whole-mesh ``echo.call`` (median, p99); the
controller's messages, open files and CPU time per call; idle USS per rank and the
controller's RSS, before and after the calls (neither may grow per call).  Each size runs
in a fresh controller (``python -m benchmarks W11`` runs fan-out 8; ``W11flat`` a flat tree,
``MONARCH_KERNEL_FANOUT=1024``).  Sizes: MONARCH_KERNEL_SCALE_SIZES (default 256,512,1024).
"""

from __future__ import annotations

import os
import resource
import time

from ._util import log, spawn_bench, summary_us, time_calls


def _sizes() -> list[int]:
    return [int(s) for s in os.environ.get("MONARCH_KERNEL_SCALE_SIZES", "256,512,1024").split(",") if s]


def _uss_mib(pids) -> float:
    import psutil

    total, n = 0, 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().uss
            n += 1
        except psutil.Error:
            continue
    return round(total / max(n, 1) / 2**20, 2)


def _rss_mib() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_size(n: int) -> dict:
    from monarch_kernel.runtime.process import Runtime

    t = time.perf_counter()
    procs, mesh = spawn_bench(n)
    out: dict = {"spawn_s": round(time.perf_counter() - t, 2)}
    try:
        rt = Runtime.current()
        mesh.echo.call(0).get(timeout=300)
        pids = [row["pid"] for row in procs.rank_states() if row["pid"]]
        out["idle_uss_per_rank_MiB"] = _uss_mib(pids)
        out["controller_rss_MiB_before"] = _rss_mib()

        def call(i):
            assert len(mesh.echo.call(i).get(timeout=300)) == n

        s, r, cpu = rt.transport.sent, rt.receiver.received, _cpu_s()
        samples = time_calls(call, 5, 40)
        calls = 45
        out["call_all_us"] = summary_us(samples)
        out["msgs_sent_per_call"] = round((rt.transport.sent - s) / calls, 2)
        out["msgs_received_per_call"] = round((rt.receiver.received - r) / calls, 2)
        out["controller_cpu_ms_per_call"] = round((_cpu_s() - cpu) / calls * 1e3, 2)
        out["controller_fds"] = len(os.listdir("/proc/self/fd"))
        out["controller_rss_MiB_after"] = _rss_mib()
        out["fanout"] = rt.outbox.fanout
    finally:
        t = time.perf_counter()
        procs.stop().get(timeout=300)
        out["stop_s"] = round(time.perf_counter() - t, 2)
    log(f"W11 n={n}: {out}")
    return out


def w11() -> dict:
    f = os.environ.get("MONARCH_KERNEL_FANOUT", "8")
    return {"W11_scale": {f"n{n}_fanout{f}": one_size(n) for n in _sizes()}}
