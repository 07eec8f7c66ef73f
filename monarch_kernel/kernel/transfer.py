"""``%mesh scatter`` and ``%mesh gather``: split a list, array or tensor across ranks along
its first dim, and join the pieces back.  Runs in the kernel; pure functions.
"""

from __future__ import annotations

from IPython.core.error import UsageError


def split_along_ranks(value, n: int) -> list:
    """Contiguous, nearly equal chunks of ``value`` along its first dim, one per rank."""
    mod = type(value).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return list(torch.tensor_split(value, n))
    if mod == "numpy":
        import numpy

        return list(numpy.array_split(value, n))
    if isinstance(value, (list, tuple, range)):
        k, extra = divmod(len(value), n)
        out, start = [], 0
        for i in range(n):
            end = start + k + (1 if i < extra else 0)
            out.append(value[start:end])
            start = end
        return out
    raise UsageError(f"%mesh scatter needs a list, tuple, numpy array or torch tensor, not {type(value).__name__}; "
                     f"use %mesh push to send the same value to every rank")


def join_along_ranks(parts: list):
    """The inverse of ``split_along_ranks``."""
    mod = type(parts[0]).__module__.split(".")[0] if parts else ""
    if mod == "torch":
        import torch

        return torch.cat(parts)
    if mod == "numpy":
        import numpy

        return numpy.concatenate(parts)
    if all(isinstance(p, (list, tuple, range)) for p in parts):
        out = []
        for p in parts:
            out.extend(p)
        return out
    return parts
