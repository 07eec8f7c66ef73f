"""W4: moving a 64 MiB float32 torch tensor.

W4a: as an argument from the controller to one rank whose endpoint returns ``t.numel()``.
W4b: rank to rank through ``RDMABuffer.read_into`` into a warm destination, once per
transport usable here (forced with ``MONARCH_KERNEL_DATA_TRANSPORT``).  Both report
bytes / 1e6 / median seconds, beside a warm memcpy and a raw loopback TCP
``sendall``/``recv_into`` of the same size measured in the same run.
"""

from __future__ import annotations

import statistics

from ._util import log, spawn_bench, time_calls
from .floors import memcpy, tcp_loopback

NBYTES = 64 << 20


def w4a() -> dict:
    import torch

    t = torch.ones(NBYTES // 4, dtype=torch.float32)
    procs, mesh = spawn_bench(1)
    try:
        def send(_i):
            assert mesh.numel.call_one(t).get(timeout=60) == t.numel()

        samples = time_calls(send, 2, 10)  # warm-up also makes the rank import torch
    finally:
        procs.stop().get(timeout=30)
    med = statistics.median(samples)
    return {"W4a_tensor_arg_MBps": round(NBYTES / 1e6 / med, 1),
            "W4a_tensor_arg_ms": {"median": round(med * 1e3, 2), "min": round(min(samples) * 1e3, 2),
                                  "max": round(max(samples) * 1e3, 2)}}


def w4b(transport: str, runs: int = 16) -> dict:
    from monarch_kernel import this_host

    from ._actors import DataBench

    with this_host().spawn_procs(per_host={"gpus": 2}, env={"MONARCH_KERNEL_DATA_TRANSPORT": transport}) as procs:
        owner = procs.slice(gpus=0).spawn("owner", DataBench)
        reader = procs.slice(gpus=1).spawn("reader", DataBench)
        buf = owner.register.call_one(NBYTES).get(timeout=60)
        used, samples = reader.read_times.call_one(buf, 2, runs).get(timeout=300)
    assert used == transport, (used, transport)
    med = statistics.median(samples)
    return {"MBps": round(NBYTES / 1e6 / med, 1), "ms_median": round(med * 1e3, 2),
            "ms_min": round(min(samples) * 1e3, 2)}


def w4() -> dict:
    from monarch_kernel.data import transports

    out = w4a()
    usable = [t["name"] for t in transports() if t["available"] and t["name"] != "cuda_ipc"]
    out["W4b_rdma_read"] = {name: w4b(name) for name in usable}
    out["W4b_unavailable"] = {t["name"]: t["reason"] for t in transports() if not t["available"]}
    # The ceilings, measured in this same job (the floors job measures them too, earlier).
    out["W4_memcpy_64MiB_MBps"] = memcpy()
    out["W4_tcp_loopback_64MiB_MBps"] = tcp_loopback(runs=16)
    out["W4_tcp_loopback_4MiB_buffers_64MiB_MBps"] = tcp_loopback(runs=16, sockbuf=4 << 20)
    log(f"W4: {out}")
    return out
