"""W2: one rank, sequential ``call_one(i).get()`` latency of a sync and an async ``echo``.
W3: ``echo.call(i).get()`` (a whole ValueMesh) on N=4, 8, 16 ranks.  W8: the same on 32
and 64 ranks, plus the messages the controller sends and receives per call (transport
counters), for the default fanout (8) and, in a second process, a flat tree (fanout 64).
"""

from __future__ import annotations

import os

from ._util import log, spawn_bench, summary_us, time_calls


def w2() -> dict:
    procs, mesh = spawn_bench(1)
    try:
        def sync(i):
            assert mesh.echo.call_one(i).get() == i

        def aio(i):
            assert mesh.aecho.call_one(i).get() == i

        out = {"W2_call_one_us": summary_us(time_calls(sync, 100, 2000)),
               "W2_call_one_async_us": summary_us(time_calls(aio, 100, 2000))}
    finally:
        procs.stop().get(timeout=30)
    log(f"W2: {out}")
    return out


def _call_all(n: int, warmup: int = 100, timed: int = 500, count_msgs: bool = False) -> dict:
    from monarch_kernel.runtime.process import Runtime

    procs, mesh = spawn_bench(n)
    try:
        def call(i):
            vm = mesh.echo.call(i).get()
            assert len(vm) == n

        res = summary_us(time_calls(call, warmup, timed))
        if count_msgs:
            rt = Runtime.current()
            calls = 100
            s, r = rt.transport.sent, rt.receiver.received
            for i in range(calls):
                mesh.echo.call(i).get()
            res["msgs_sent_per_call"] = (rt.transport.sent - s) / calls
            res["msgs_received_per_call"] = (rt.receiver.received - r) / calls
            res["fanout"] = rt.outbox.fanout
    finally:
        procs.stop().get(timeout=60)
    log(f"call on {n} ranks: {res}")
    return res


def w3() -> dict:
    return {"W3_call_all_us": {f"n{n}": _call_all(n) for n in (4, 8, 16)}}


def _sizes() -> list[int]:
    import psutil

    avail_gib = psutil.virtual_memory().available / (1 << 30)
    if avail_gib < 6:  # ~60 MiB RSS per rank, most of it shared with the template
        log(f"W8: only {avail_gib:.1f} GiB available; skipping 64 ranks")
        return [32]
    return [32, 64]


def w8() -> dict:
    return {"W8_fanout": {f"n{n}": _call_all(n, count_msgs=True) for n in _sizes()}}


def w8_flat() -> dict:
    """Run with MONARCH_KERNEL_FANOUT=64: the controller talks to every rank itself."""
    f = os.environ.get("MONARCH_KERNEL_FANOUT", "8")
    return {"W8_fanout": {f"n{n}_fanout{f}": _call_all(n, count_msgs=True) for n in _sizes()}}
