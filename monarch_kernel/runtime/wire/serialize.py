"""Pickling with out-of-band buffers: arrays and tensors travel as their own frames.

cloudpickle pickles classes and functions from ``__main__`` or a notebook cell by value, so
ranks never import the user's main module.  torch is only touched when a tensor is being
pickled (it is then already imported by the caller); this module never imports it itself.
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings

import cloudpickle

from . import segments as _shm

# Buffers smaller than this are cheaper to copy than to send as their own frame.
_OOB_MIN = 4096



def _tensor_reducer(obj):
    """A zero-copy reduction if ``obj`` is a plain CPU tensor (or, with shared memory on
    offer, a large numpy array), else None."""
    # getattr: while another thread is still importing torch (or numpy), the module is in
    # sys.modules without its classes yet, and no instance of them can exist.
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    if tensor is not None and type(obj) is tensor:
        return _reduce_tensor(torch, obj)
    segments = _shm.tracking()  # pickling arguments for ranks on this host (see segments.py)
    if segments is not None:
        np = sys.modules.get("numpy")
        array = getattr(np, "ndarray", None)
        if array is not None and type(obj) is array and obj.nbytes >= _shm.SHM_MIN and obj.dtype.hasobject is False:
            a = np.ascontiguousarray(obj)
            path = segments.write(memoryview(a.reshape(-1).view(np.uint8)))
            if path is not None:  # else /dev/shm is full: numpy's own out-of-band frame
                return _rebuild_array_shm, (path, a.nbytes, a.dtype.str, a.shape)
    return None


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        return _tensor_reducer(obj) or super().reducer_override(obj)


class _TensorPickler(pickle.Pickler):
    """The plain (C) pickler plus zero-copy tensors, for when torch is loaded."""

    def reducer_override(self, obj):
        return _tensor_reducer(obj) or NotImplemented


def _reduce_tensor(torch, t):
    """Its bytes, dtype and shape: torch's own reduction costs a small tensor about 50 us to
    pickle and 70 to unpickle here, this one a few; a small one's bytes go inline."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    try:
        import numpy  # noqa: F401  (tensor.numpy() needs it)
    except ImportError:
        return None
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    dtype = str(t.dtype).removeprefix("torch.")
    if raw.nbytes < _OOB_MIN:
        return _rebuild_tensor, (raw.tobytes(), dtype, tuple(t.shape), t.requires_grad)
    segments = _shm.tracking()
    if segments is not None and raw.nbytes >= _shm.SHM_MIN:
        path = segments.write(memoryview(raw))
        if path is not None:  # else /dev/shm is full: an out-of-band frame, as across hosts
            return _rebuild_tensor_shm, (path, raw.nbytes, dtype, tuple(t.shape), t.requires_grad)
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(t.shape), t.requires_grad)


_COPY_BELOW = 1 << 20


def _rebuild_tensor(buf, dtype, shape, requires_grad):
    import torch

    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
    else:
        if mv.readonly:
            # A small tensor packed into the message's one frame (read-only bytes): a copy is
            # cheap; a large frame is this message's own, so its memory may back the tensor.
            if mv.nbytes < _COPY_BELOW:
                mv = memoryview(bytearray(mv))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.frombuffer(mv, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
                if requires_grad:
                    t.requires_grad_(True)
                return t
        t = torch.frombuffer(mv, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_tensor_shm(path, nbytes, dtype, shape, requires_grad):
    try:
        buf = _shm.map_private(path, nbytes)
    except FileNotFoundError:
        raise RuntimeError(f"the shared-memory segment {path} for a tensor argument is gone: "
                           "its sender finished the call or exited") from None
    return _rebuild_tensor(buf, dtype, shape, requires_grad)


def _rebuild_array_shm(path, nbytes, dtype, shape):
    import numpy as np

    try:
        buf = _shm.map_private(path, nbytes)
    except FileNotFoundError:
        raise RuntimeError(f"the shared-memory segment {path} for an array argument is gone: "
                           "its sender finished the call or exited") from None
    return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)


_SCALARS = frozenset((int, float, bool, str, type(None)))


def is_plain(obj) -> bool:
    """Whether ``obj`` is a scalar, or a call's ``(args, kwargs)`` of scalars: nothing in it
    can be a tensor, an array or a reference to ``__main__``, so ``pickle`` alone does."""
    t = type(obj)
    if t in _SCALARS:
        return t is not str or len(obj) < _OOB_MIN
    if t is tuple and len(obj) == 2 and type(obj[0]) is tuple and type(obj[1]) is dict and len(obj[0]) < 8:
        scalars = _SCALARS
        for a in obj[0]:
            if type(a) not in scalars or (type(a) is str and len(a) >= _OOB_MIN):
                return False
        for a in obj[1].values():
            if type(a) not in scalars or (type(a) is str and len(a) >= _OOB_MIN):
                return False
        return True
    return False


def dumps_plain(obj) -> list | None:
    """``dumps(obj)`` when ``obj`` is ``plain`` (no shared memory can be involved), else None."""
    return [pickle.dumps(obj, 5)] if is_plain(obj) else None


def dumps(obj) -> list:
    """Pickle ``obj``; returns ``[pickle_bytes, buffer, ...]`` ready to be zmq frames.

    The C pickler goes first (several times cheaper to start); anything it cannot do, or
    any reference to ``__main__`` (which the receiver does not share), goes to cloudpickle,
    which pickles such classes and functions by value.
    """
    if is_plain(obj):
        return [pickle.dumps(obj, 5)]
    bufs: list = []
    f = io.BytesIO()
    try:
        override = "torch" in sys.modules or _shm.tracking() is not None
        (_TensorPickler if override else pickle.Pickler)(
            f, protocol=5, buffer_callback=bufs.append
        ).dump(obj)
        plain = b"__main__" not in f.getvalue()
    except Exception:
        plain = False
    if not plain:
        bufs.clear()
        f = io.BytesIO()
        _Pickler(f, protocol=5, buffer_callback=bufs.append).dump(obj)
    frames = [f.getbuffer()]
    for b in bufs:
        frames.append(b.raw())
    return frames


def describe_unpicklable(obj, err: BaseException) -> str:
    return f"{type(err).__name__}: {err} (while pickling a {type(obj).__module__}.{type(obj).__qualname__})"
