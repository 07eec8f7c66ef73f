"""Warm memory for large results of reductions on CPU.

A reduction that returns a new tensor (``t.reduce``) writes every byte of a fresh buffer.
glibc serves blocks of 32 MiB and more straight from the kernel each time (``mmap``) and
gives them back on free, so each such result faults all its pages in again: for a 64 MiB
sum on a loaded 2-core machine that doubled the time of the reduction itself.  Here a
result's memory comes from a few anonymous mappings kept warm: once the last tensor (or
view) over one is gone, the mapping is free for the next result.  Bounded (``POOL_BYTES``);
smaller results, and CUDA ones, use torch's allocators.  Such a tensor's storage cannot be
resized (``resize_`` to a larger size raises); everything else is an ordinary CPU tensor.
Nothing runs at import.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Any

MIN_BYTES = 32 << 20  # below this glibc keeps freed blocks warm itself
POOL_BYTES = 512 << 20  # free mappings kept, at most

_lock = threading.Lock()
_free: list[mmap.mmap] = []


def empty(shape, dtype: Any, device: Any = None) -> Any:
    """``torch.empty(shape, dtype=dtype, device=device)``, from warm memory when it is a
    large CPU tensor."""
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    mm = _take(nbytes)
    view = memoryview(mm)[:nbytes]
    weakref.finalize(view, _give_back, mm)  # runs once no tensor uses the memory any more
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(tuple(shape))


def _take(nbytes: int) -> mmap.mmap:
    with _lock:
        fits = [(len(m), i) for i, m in enumerate(_free) if nbytes <= len(m) <= 2 * nbytes]
        if fits:
            return _free.pop(min(fits)[1])
    return mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def _give_back(mm: mmap.mmap) -> None:
    with _lock:
        _free.append(mm)
        while sum(len(m) for m in _free) > POOL_BYTES:
            _free.pop(0).close()


def trim() -> None:
    """Unmap the free warm buffers."""
    with _lock:
        gone, _free[:] = list(_free), []
    for m in gone:
        m.close()
