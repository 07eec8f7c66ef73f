"""Monarch's reductions, as rules: which arguments make sense, which (reduction, dtype) pairs
a backend reduces itself, and the local reduction over a gathered stack for the rest.

``stack`` gathers (a new outer dim of the group's size); the others combine elementwise and
keep the dtype: ``sum``, ``avg``, ``product``, ``min``, ``max``, and on integer or bool
tensors ``band``, ``bor``, ``bxor``.  ``avg`` of integers divides the sum, truncating, as
nccl does.  Pure functions of torch tensors; torch is imported only when one is called.
"""

from __future__ import annotations

import functools
from typing import Any

REDUCTIONS = ("stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")


def check(reduction: str, scatter: bool, inplace: bool, ndims: int, local: Any, group_size: int) -> None:
    """Raise, with the fix, for arguments no backend could honour (the same on every rank,
    so every rank raises before any of them communicates)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not one of Monarch's: {', '.join(REDUCTIONS)}")
    if ndims > 1 and (reduction == "stack" or scatter):
        raise ValueError(f"reduction='{reduction}'{' with scatter=True' if scatter else ''} takes one dim, not "
                         f"{ndims}; reduce over one dim, or flatten the dims first (mesh.flatten('x'))")
    if scatter and (local.dim() == 0 or local.size(0) != group_size):
        raise ValueError(f"scatter=True splits the tensor's outer dim across the {group_size} ranks of the dim, "
                         f"so it must have size {group_size}; this tensor has shape {tuple(local.shape)}")
    if inplace and scatter != (reduction == "stack"):
        what = "reduce_scatter" if scatter else "stack (all_gather)"
        raise ValueError(f"reduce_ with {what} changes the tensor's shape, so it cannot be in place; use "
                         "reduce(...), which returns a new tensor")
    if reduction in BITWISE and (local.is_floating_point() or local.is_complex()):
        raise TypeError(f"reduction='{reduction}' is bitwise: it needs an integer or bool tensor, not "
                        f"{str(local.dtype).removeprefix('torch.')}")
    if reduction in ("min", "max") and local.is_complex():
        raise TypeError(f"reduction='{reduction}' has no order on complex tensors; reduce .real or .abs()")


def native_op(backend: str, reduction: str, dtype: Any):
    """The ``ReduceOp`` with which ``backend`` reduces ``dtype`` itself, or None when it
    cannot (the caller gathers and reduces locally: same result, more bytes moved)."""
    import torch
    import torch.distributed as dist

    floats = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
    ints = {torch.int8, torch.uint8, torch.int32, torch.int64}
    supported: dict[str, set] = {
        "sum": floats | ints, "product": floats | ints, "min": floats | ints, "max": floats | ints,
        "avg": floats,
    }
    if backend == "gloo":
        supported.update({op: ints for op in BITWISE})
    elif backend != "nccl":
        return None
    if dtype not in supported.get(reduction, set()):
        return None
    return getattr(dist.ReduceOp, {"product": "PRODUCT"}.get(reduction, reduction.upper()))


def combine(stacked: Any, reduction: str) -> Any:
    """Reduce a gathered stack over its outer dim, keeping the dtype (what the backend would
    have computed)."""
    import torch

    n = stacked.size(0)
    parts = stacked.unbind(0)
    if stacked.dtype == torch.bool:
        if reduction in ("sum", "max", "bor"):
            return stacked.any(0)
        if reduction in ("product", "min", "band"):
            return stacked.all(0)
        if reduction == "bxor":
            return functools.reduce(torch.bitwise_xor, parts).clone()
        raise TypeError("reduction='avg' of a bool tensor has no bool result; convert it first (t.float())")
    if reduction == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if reduction == "product":
        return stacked.prod(0, dtype=stacked.dtype)
    if reduction == "min":
        return stacked.amin(0)
    if reduction == "max":
        return stacked.amax(0)
    if reduction == "avg":
        total = stacked.sum(0, dtype=stacked.dtype)
        if stacked.is_floating_point() or stacked.is_complex():
            return (total / n).to(stacked.dtype)
        return torch.div(total, n, rounding_mode="trunc")
    if reduction in BITWISE:
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[reduction]
        return functools.reduce(fn, parts).clone()
    raise ValueError(f"no local reduction {reduction!r}")
