"""W4: moving a 64 MiB float32 torch tensor.

W4a: as an argument from the controller to one rank whose endpoint returns ``t.numel()``.
W4b: rank to rank through ``RDMABuffer.read_into`` into a warm destination, once per
transport usable here (forced with ``MONARCH_KERNEL_DATA_TRANSPORT``).  Both report
bytes / 1e6 / median seconds, beside a warm memcpy and a raw loopback TCP
``sendall``/``recv_into`` of the same size measured in the same run.
W4c: a 4 KiB read, rank to rank over the best transport, beside the same run's ``call_one``
round trip to the reading rank (issue 46: at most 1.5x).
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


def w4c(nbytes: int = 4096, runs: int = 400) -> dict:
    """A small read rank to rank against a call_one round trip to the reader, interleaved in
    rounds so that load from elsewhere hits both alike."""
    from monarch_kernel import this_host

    from ._actors import DataBench

    reads: list[float] = []
    calls: list[float] = []
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        owner = procs.slice(gpus=0).spawn("owner", DataBench)
        reader = procs.slice(gpus=1).spawn("reader", DataBench)
        buf = owner.register.call_one(nbytes).get(timeout=60)
        used, _ = reader.read_times.call_one(buf, 20, 20).get(timeout=60)
        for _round in range(4):
            calls += time_calls(lambda _i: reader.noop.call_one().get(timeout=30), 20, runs // 4)
            reads += reader.read_times.call_one(buf, 5, runs // 4).get(timeout=120)[1]
    read, call = statistics.median(reads), statistics.median(calls)
    return {"transport": used, "read_us": {"median": round(read * 1e6, 1), "min": round(min(reads) * 1e6, 1)},
            "call_one_us": {"median": round(call * 1e6, 1), "min": round(min(calls) * 1e6, 1)},
            "read_over_call_one": round(read / call, 2)}


def w4() -> dict:
    from monarch_kernel.data import transports

    out = w4a()
    out["W4c_4KiB_read"] = w4c()
    usable = [t["name"] for t in transports() if t["available"] and t["name"] != "cuda_ipc"]
    out["W4b_rdma_read"] = {name: w4b(name) for name in usable}
    out["W4b_unavailable"] = {t["name"]: t["reason"] for t in transports() if not t["available"]}
    # The ceilings, measured in this same job (the floors job measures them too, earlier).
    from .gpu import reads

    # The same read beside torch's copy_ of as many bytes in the reading rank, alternated.
    out["W4b_shm_beside_copy"] = reads("cpu", [NBYTES])["64 MiB"]
    out["W4_memcpy_64MiB_MBps"] = memcpy()
    shm = out["W4b_rdma_read"].get("shm")
    if shm and out["W4_memcpy_64MiB_MBps"]:
        out["W4b_shm_over_memcpy"] = round(shm["MBps"] / out["W4_memcpy_64MiB_MBps"], 2)
    out["W4_tcp_loopback_64MiB_MBps"] = tcp_loopback(runs=16)
    out["W4_tcp_loopback_4MiB_buffers_64MiB_MBps"] = tcp_loopback(runs=16, sockbuf=4 << 20)
    log(f"W4: {out}")
    return out
