"""What a rank's executor sends back to the controller (tensors detached, on the CPU, small
ones as their bytes), and the functions the controller's recording runs on a rank to ask it
where it is.  Used only once a tensor exists, so it imports torch."""

from __future__ import annotations

import torch

from ..messages import unpack_tensor

_SEQ = (list, tuple)
_PACK_MAX = 4096  # smaller tensors travel as bytes; larger ones as the runtime's zero-copy frames
_running: list = [None]  # the executor whose batch runs now (for functions that ask their rank)


class _Packed:
    """A small CPU tensor on its way to the controller, as its bytes."""

    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        t = self.t.resolve_conj().resolve_neg().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return (unpack_tensor, (raw, str(t.dtype).removeprefix("torch."), tuple(t.shape)))


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
    """What a fetch sends back: tensors detached, on the CPU, and no bigger than they are
    (a small view of a large tensor would pickle all of its storage)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        nbytes = t.numel() * t.element_size()
        if nbytes < _PACK_MAX and t.layout == torch.strided and not t.is_quantized:
            return _Packed(t)
        if t.untyped_storage().nbytes() > nbytes:
            t = t.clone()
        return t
    if type(value) in _SEQ:
        return type(value)(_to_controller(v) for v in value)
    if type(value) is dict:
        return {k: _to_controller(v) for k, v in value.items()}
    return value
