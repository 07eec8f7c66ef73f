"""Turning what a user registers or reads into (a byte view of contiguous memory).

Torch tensors, numpy arrays, bytearrays, memoryviews and mmaps are accepted; anything
non-contiguous is refused with the call that fixes it.  torch and numpy are only looked up
in ``sys.modules``: a rank imports them only when such an object is in hand.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass


@dataclass
class Memory:
    """Contiguous bytes of a registered or destination object, and how to share them."""

    view: memoryview  # format "B", nbytes long; empty for CUDA memory
    nbytes: int
    obj: object  # keeps the owner alive while the view is in use
    device: str = "cpu"  # "cpu" or "cuda:N"
    tensor: object = None  # the torch tensor, if it is one
    readonly: bool = False


def describe(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def as_memory(obj, *, writable: bool, what: str) -> Memory:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_memory(torch, obj, what)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what} must be contiguous; pass np.ascontiguousarray(a) instead")
        if obj.dtype.hasobject:
            raise TypeError(f"{what} holds Python objects (dtype=object); only raw data can move")
        flat = obj.reshape(-1).view(np.uint8)
        return Memory(memoryview(flat), obj.nbytes, obj, readonly=not obj.flags.writeable)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} must be a torch tensor, a numpy array, a bytearray or another "
                        f"buffer, not {describe(obj)}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be contiguous memory")
    return Memory(mv.cast("B") if mv.nbytes else memoryview(b""), mv.nbytes, obj, readonly=mv.readonly)


def _tensor_memory(torch, t, what: str) -> Memory:
    if not t.is_contiguous():
        raise ValueError(f"{what} is a non-contiguous tensor (shape {tuple(t.shape)}, stride "
                         f"{t.stride()}); pass t.contiguous() instead")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{what} must be a dense tensor, not layout {t.layout}")
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cuda":
        return Memory(memoryview(b""), nbytes, t, device=str(t.device), tensor=t)
    if t.device.type != "cpu":
        raise TypeError(f"{what} is on {t.device}; only CPU and CUDA tensors can be registered")
    if nbytes == 0:
        return Memory(memoryview(bytearray()), 0, t, tensor=t)
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return Memory(memoryview(raw).cast("B"), nbytes, t, tensor=t)


def move_to_shared(mem: Memory) -> tuple[int, int, int] | None:
    """Move a CPU tensor's storage into shared memory, in place for every view of it.

    Returns ``(fd, storage bytes, byte offset of the tensor)``; the fd refers to an already
    unlinked segment, so nothing is left in ``/dev/shm`` whatever happens to the process.
    None for memory that cannot move (numpy arrays, bytearrays: their owner keeps the
    pointer), or that ``/dev/shm`` has no room for; peers then copy it out of the owner's
    memory or stream it over the local socket instead.
    """
    t = mem.tensor
    if t is None or mem.device != "cpu" or mem.nbytes == 0:
        return None
    torch = sys.modules["torch"]
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return None
    if not t.is_shared() and _shm_free() < t.untyped_storage().nbytes():
        # torch would create a named /dev/shm/torch_* file, fail to allocate it, and leave it.
        return None
    try:
        t.share_memory_()
        storage = t.untyped_storage()
        fd, size = storage._share_fd_cpu_()
    except (RuntimeError, AttributeError) as e:
        _unlink_torch_leftover(str(e))
        return None
    # The storage moved: refresh the view onto its new address.
    mem.view = memoryview((ctypes.c_char * mem.nbytes).from_address(t.data_ptr())).cast("B")
    offset = t.data_ptr() - storage.data_ptr()
    return fd, size, offset


def _shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _unlink_torch_leftover(message: str) -> None:
    """torch names the segment it failed to fill in its error ("... for file </torch_1_2_0>");
    it unlinks the name only after a successful mapping, so a failure leaves it behind."""
    m = re.search(r"<(/torch_\d+_[^>/]+)>", message)
    if m is not None and m.group(1).startswith(f"/torch_{os.getpid()}_"):
        try:
            os.unlink("/dev/shm" + m.group(1))
        except FileNotFoundError:
            pass
