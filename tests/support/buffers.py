"""What the data plane's tests fill buffers with and check them by: a seeded byte pattern and
its CRC (tests/data/test_data.py, test_fast_path.py; ranks import it to make their buffers)."""

from __future__ import annotations

import zlib

import torch

MiB = 1 << 20


def pattern(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` bytes, the same for the same ``seed``, as a uint8 tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def crc(t) -> int:
    """The CRC-32 of a tensor's (or a buffer's) bytes."""
    return zlib.crc32(memoryview(t.numpy() if isinstance(t, torch.Tensor) else t).cast("B"))
