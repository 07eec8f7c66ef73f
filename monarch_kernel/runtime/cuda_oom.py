"""A CUDA out-of-memory error raised on a rank carries the headline of that rank's
``torch.cuda.memory_summary()`` (allocated and reserved memory, now and at the peak, and the
allocator's OOM and retry counts), so the notebook says how full the GPU was without a second
call to the rank.

A leaf: it never imports torch; it reads the summary only where torch is already imported and
the error is torch's ``OutOfMemoryError``.
"""

from __future__ import annotations

import re
import sys
from typing import Any

_DEVICE = re.compile(r"memory summary, device ID (\d+)")
_COUNTS = re.compile(r"CUDA OOMs: (\d+)\s*\|\s*cudaMalloc retries: (\d+)")
_ROW = re.compile(r"^\|\s*(Allocated memory|GPU reserved memory)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", re.M)


def headline(summary: str) -> str:
    """``CUDA memory of device 0: allocated 10752 MiB (peak 11468 MiB), reserved 11878 MiB
    (peak 11878 MiB); CUDA OOMs: 1, cudaMalloc retries: 3`` from a ``memory_summary()`` text."""
    device = _DEVICE.search(summary)
    rows = {name: (now, peak) for name, now, peak in _ROW.findall(summary)}
    parts = []
    for name, word in (("Allocated memory", "allocated"), ("GPU reserved memory", "reserved")):
        if name in rows:
            now, peak = rows[name]
            parts.append(f"{word} {now} (peak {peak})")
    text = f"CUDA memory of device {device[1] if device else '?'}: " + (", ".join(parts) or "no figures")
    counts = _COUNTS.search(summary)
    if counts:
        text += f"; CUDA OOMs: {counts[1]}, cudaMalloc retries: {counts[2]}"
    return text


def note(exc: BaseException) -> str | None:
    """The headline for ``exc`` if it is torch's CUDA out-of-memory error, else None."""
    torch: Any = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is None or not isinstance(exc, oom):
        return None
    try:
        return headline(torch.cuda.memory_summary(torch.cuda.current_device()))
    except Exception as e:  # noqa: BLE001 - the error itself still reaches the caller
        return f"CUDA memory: torch.cuda.memory_summary() failed here ({type(e).__name__}: {e})"
