"""The actors the chaos run (chaos.py) spawns on the hosts' ranks: echoes, its pid, a
buffer to read between hosts; and one DDP step over the mesh's process group.  In an
importable module, so ranks import it by reference.
"""

from __future__ import annotations

import os
import time
import zlib

from monarch_kernel import Actor, RDMABuffer, endpoint


class ChaosWorker(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def nap(self, s: float) -> float:
        time.sleep(s)
        return s

    @endpoint
    def make(self, n: int) -> tuple:
        """A buffer of ``n`` random bytes, kept here, and its CRC."""
        data = bytearray(os.urandom(n))
        self.kept["b"] = data
        return RDMABuffer(memoryview(data)), zlib.crc32(data)

    @endpoint
    def read(self, buf: RDMABuffer, timeout: float) -> int:
        """Read ``buf`` (owned by a rank on the other host); the CRC of what arrived."""
        dst = bytearray(buf.size)
        buf.read_into(memoryview(dst)).get(timeout=timeout)
        return zlib.crc32(dst)



class ChaosDDP(Actor):
    """Its own actor, so that a step stuck in a collective never holds the echoes up."""

    def __init__(self):
        self.model = None
        self.group = None

    @endpoint
    def ddp_step(self) -> tuple:
        """One step of a small DistributedDataParallel model over the default (gloo) group:
        (world size, the averaged gradient's sum, which every rank must agree on)."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if self.model is None or self.group is not dist.group.WORLD:
            torch.manual_seed(0)
            self.model = DistributedDataParallel(torch.nn.Linear(8, 1))
            self.group = dist.group.WORLD
        self.model.zero_grad()
        g = torch.Generator().manual_seed(dist.get_rank())
        self.model(torch.randn(4, 8, generator=g)).sum().backward()
        grad = sum(float(p.grad.sum()) for p in self.model.parameters())
        return dist.get_world_size(), round(grad, 4)
