"""What a rank's executor sends back to the controller (tensors detached, on the CPU), and
the functions the controller's recording runs on a rank to ask it where it is.  Used only
once a tensor exists, so it imports torch."""

from __future__ import annotations

import torch

_SEQ = (list, tuple)
_running: list = [None]  # the executor whose batch runs now (for functions that ask their rank)


def current_stats() -> dict:
    """On a rank, inside a request: the executor's ``stats()``."""
    return _running[0].stats()


def coordinate(ranks: tuple, sizes: tuple, axis: int):
    """On a rank, inside a batch: this rank's index along dim ``axis`` of the mesh whose
    ranks (row-major) are ``ranks`` and dims ``sizes`` (``procs.rank_tensor(dim)``)."""
    ex = _running[0]
    flat = ranks.index(ex.rank)
    for size in reversed(sizes[axis + 1:]):
        flat //= size
    return torch.tensor(flat % sizes[axis])


def _to_controller(value):
    """What a fetch sends back: tensors detached, on the CPU, and no bigger than they are.
    The runtime's pickling sends a strided tensor's own values (a small one inline as its
    bytes); torch's, used for a quantized one, would send all of a view's storage."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_quantized and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        return t
    if type(value) in _SEQ:
        return type(value)(_to_controller(v) for v in value)
    if type(value) is dict:
        return {k: _to_controller(v) for k, v in value.items()}
    return value
