"""The actor every benchmark spawns.  It lives in an importable module, so ranks import it
by reference (the way library code reaches ranks) rather than receiving it by value.
"""

from __future__ import annotations

import os
import time

from monarch_kernel import Actor, endpoint


class Bench(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    async def aecho(self, x: int) -> int:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def numel(self, t) -> int:
        return t.numel()

    @endpoint
    def exit_now(self, stamp_path: str) -> None:
        """Write the wall-clock time, then die with exit code 1 (no cleanup)."""
        with open(stamp_path, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)

    @endpoint
    def sleep(self, seconds: float, started_path: str) -> int:
        """Mark the file ``started_path``, then sleep: a call that stays pending."""
        with open(started_path, "w") as f:
            f.write("started")
        time.sleep(seconds)
        return os.getpid()


class DataBench(Actor):
    """Owner and reader of W4b's RDMABuffer."""

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def register(self, nbytes: int):
        import torch

        from monarch_kernel import RDMABuffer

        self.t = torch.ones(nbytes // 4, dtype=torch.float32)
        return RDMABuffer(self.t, name="w4b")

    @endpoint
    def read_times(self, buf, warmup: int, runs: int) -> tuple:
        import torch

        dst = torch.zeros(buf.size, dtype=torch.uint8)  # touched: no page faults while timed
        out = []
        for i in range(warmup + runs):
            t0 = time.perf_counter()
            buf.read_into(dst).get(timeout=60)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        assert float(dst.view(torch.float32)[:1000].sum()) == 1000.0
        return buf.transport(), out


class TorchUser(Actor):
    """W10restart: imports torch when first called, as a training cell would."""

    @endpoint
    def total(self) -> float:
        import torch

        return float(torch.ones(4).sum())
