"""Turning what a user registers or reads into a byte view of contiguous memory, and copying
between two such views.  It must never import torch or numpy (they are only looked up in
``sys.modules``: a rank imports them only when such an object is in hand).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

# Torch tensors, numpy arrays, bytearrays, memoryviews and mmaps are accepted; anything
# non-contiguous is refused with the call that fixes it.


@dataclass
class Memory:
    """Contiguous bytes of a registered or destination object, and how to share them."""

    view: memoryview  # format "B", nbytes long; empty for CUDA memory
    nbytes: int
    obj: object  # keeps the owner alive while the view is in use
    device: str = "cpu"  # "cpu" or "cuda:N"
    tensor: Any = None  # the torch tensor, if it is one (Any: this module never imports torch)
    readonly: bool = False


def describe(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def as_memory(obj, *, writable: bool, what: str) -> Memory:
    # getattr: torch or numpy may be half imported by another thread (no classes yet)
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    if torch is not None and tensor is not None and isinstance(obj, tensor):
        return _tensor_memory(torch, obj, what)
    np = sys.modules.get("numpy")
    array = getattr(np, "ndarray", None)
    if np is not None and array is not None and isinstance(obj, array):
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


# A copy of at least PARALLEL_MIN bytes is split over up to ``threads`` threads (the
# ``data_copy_threads`` setting), each part at least PART_MIN and page aligned: one thread
# reaches a fraction of a many-core host's memory bandwidth, and torch's own ``copy_`` splits.
PARALLEL_MIN = 16 << 20
PART_MIN = 4 << 20
PAGE = 4096


def parts(n: int, threads: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte ranges a copy of ``n`` bytes is split into: at most
    ``threads`` of them, each at least ``PART_MIN`` but the last, starts page aligned."""
    if n < PARALLEL_MIN:
        return [(0, n)]
    k = max(1, min(threads, n // PART_MIN))
    step = _round_up(_round_up(n, k) // k, PAGE)  # n / k, rounded up to a whole page
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (pid, workers): a forked child, or another bound, makes its own
_pool_lock = threading.Lock()


def _workers(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    with _pool_lock:
        if _pool is None or _pool_key != (os.getpid(), threads - 1):
            _pool, _pool_key = (ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="mk-copy"),
                                (os.getpid(), threads - 1))
        return _pool


def copy(dst: memoryview, src: memoryview, threads: int = 1) -> None:
    """memcpy without the GIL where both buffers allow it, so concurrent copies overlap; a
    large one split over up to ``threads`` threads (this one included)."""
    n = dst.nbytes
    if n == 0:
        return
    if not dst.readonly and not src.readonly:
        d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
        s = ctypes.addressof(ctypes.c_char.from_buffer(src))
        split = parts(n, threads)
        if len(split) == 1:
            ctypes.memmove(d, s, n)
            return
        pool = _workers(threads)
        futures = [pool.submit(ctypes.memmove, d + lo, s + lo, hi - lo) for lo, hi in split[1:]]
        lo, hi = split[0]
        ctypes.memmove(d + lo, s + lo, hi - lo)
        for f in futures:
            f.result()
    else:
        dst[:] = src


def prefix(mem: Memory, n: int) -> Memory:
    """The first ``n`` bytes of ``mem`` (all of it if it holds no more), sharing its memory."""
    if n >= mem.nbytes:
        return mem
    tensor = mem.tensor
    if tensor is not None:
        tensor = tensor.reshape(-1).view(sys.modules["torch"].uint8)[:n]
    view = mem.view[:n] if mem.device == "cpu" else mem.view
    return Memory(view, n, mem.obj, mem.device, tensor, mem.readonly)


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``: the one portable way to learn where read-only memory lives."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def span(mem: Memory) -> tuple[str, int, int]:
    """Where ``mem`` lives: ``(device, first address, one past the last)``."""
    if mem.tensor is not None and mem.nbytes:
        start = mem.tensor.data_ptr()
    elif not mem.nbytes:
        start = 0
    elif not mem.view.readonly:
        start = ctypes.addressof(ctypes.c_char.from_buffer(mem.view))
    else:
        pb = _PyBuffer()
        api = ctypes.pythonapi
        if api.PyObject_GetBuffer(ctypes.py_object(mem.view), ctypes.byref(pb), 0) != 0:
            raise BufferError("cannot find the address of a read-only buffer")
        start = pb.buf or 0
        api.PyBuffer_Release(ctypes.byref(pb))
    return mem.device, start, start + mem.nbytes
