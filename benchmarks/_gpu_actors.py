"""The actors ``python -m benchmarks gpu`` spawns (importable, so ranks import them by
reference): an owner and a reader of RDMABuffers on a GPU or in host memory, each timing
itself beside the copy that is its floor, and a rank of a group that reduces CUDA tensors.
"""

from __future__ import annotations

import statistics
import time

from monarch_kernel import Actor, RDMABuffer, current_rank, endpoint


def _median_s(fn, warmup: int, runs: int, sync=None) -> float:
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class CopyBench(Actor):
    """Owner (``register``) or reader (``read_vs_copy``) of one buffer."""

    @endpoint
    def register(self, nbytes: int, device: str) -> RDMABuffer:
        import torch

        self.t = torch.ones(nbytes, dtype=torch.uint8, device=device)
        return RDMABuffer(self.t, name=f"bench-{device}")

    @endpoint
    def release(self) -> None:
        self.t = None

    @endpoint
    def read_vs_copy(self, buf: RDMABuffer, device: str, runs: int) -> dict:
        """Median seconds of ``read_into`` and of ``copy_`` of as many bytes on this device
        (device to device on a GPU, into a preallocated tensor on the CPU), same process,
        alternated so that load from elsewhere hits both alike."""
        import torch

        dst = torch.zeros(buf.size, dtype=torch.uint8, device=device)
        src = torch.ones(buf.size, dtype=torch.uint8, device=device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        reads, copies = [], []
        for i in range(runs + 3):
            t0 = time.perf_counter()
            buf.read_into(dst).get(timeout=120)
            t1 = time.perf_counter()
            dst.copy_(src)
            sync()
            t2 = time.perf_counter()
            if i >= 3:
                reads.append(t1 - t0)
                copies.append(t2 - t1)
        read, copy = statistics.median(reads), statistics.median(copies)
        assert int(dst[:4096].sum()) == 4096
        return {"transport": buf.transport(device), "read_ms": round(read * 1e3, 4), "copy_ms": round(copy * 1e3, 4),
                "read_over_copy_speed": round(copy / read, 2), "read_GBps": round(buf.size / read / 1e9, 2)}

    @endpoint
    def tensor_ops(self) -> dict:
        """A few CUDA ops timed on this rank: matmul, elementwise, a reduction."""
        import torch

        a = torch.randn(4096, 4096, device="cuda")
        b = torch.randn(4096, 4096, device="cuda")
        sync = torch.cuda.synchronize
        mm = _median_s(lambda: a @ b, 3, 20, sync)
        add = _median_s(lambda: a.add_(1.0), 3, 50, sync)
        total = _median_s(lambda: a.sum(), 3, 50, sync)
        return {"matmul_4096_ms": round(mm * 1e3, 3), "matmul_TFLOPs": round(2 * 4096 ** 3 / mm / 1e12, 1),
                "add_16M_ms": round(add * 1e3, 4), "sum_16M_ms": round(total * 1e3, 4)}

    @endpoint
    def all_reduce(self, nbytes: int, runs: int) -> dict:
        """``all_reduce`` of a CUDA tensor over the default group (set up by the caller)."""
        import torch
        import torch.distributed as dist

        t = torch.full((nbytes // 4,), float(current_rank().rank + 1), device="cuda")
        took = _median_s(lambda: dist.all_reduce(t), 2, runs, torch.cuda.synchronize)
        return {"backend": dist.get_backend(), "ms": round(took * 1e3, 3)}
