"""W4a: throughput of a 64 MiB float32 torch tensor sent as an argument from the controller
to one rank whose endpoint returns ``t.numel()``: bytes / 1e6 / median seconds of 10 calls.
W4b (RDMABuffer read) is reported as null until the data plane exists.
"""

from __future__ import annotations

import statistics

from ._util import log, spawn_bench, time_calls

NBYTES = 64 << 20


def w4() -> dict:
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
    out = {"W4a_tensor_arg_MBps": round(NBYTES / 1e6 / med, 1),
           "W4a_tensor_arg_ms": {"median": round(med * 1e3, 2), "min": round(min(samples) * 1e3, 2),
                                 "max": round(max(samples) * 1e3, 2)},
           "W4b_rdma_read_MBps": None,
           "W4b_note": "RDMABuffer arrives with the data-plane issue"}
    log(f"W4: {out}")
    return out
