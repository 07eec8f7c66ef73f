"""``Tensor``: the controller's handle on a distributed tensor.  A torch wrapper subclass
with no storage: its shape, strides, dtype, device and ``requires_grad`` are those every
rank's shard has, known at once; the values live on the ranks, under its ref.

Torch calls on it run on its own mesh, inside ``activate()`` or not (Monarch's rule: the
active mesh only says where factories make tensors); anything that needs values says how
to get them.  Dropping the handle frees the shards (the client batches the deletes).
Used only once a tensor exists, so it imports torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from ..messages import Ref
from .meshes import state

# Functions that read only a tensor's metadata: answered by the handle itself, no message.
_GETTERS = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda",
            "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "itemsize",
            "nbytes", "output_nr", "_version", "is_mps", "is_xpu", "retains_grad", "_base", "_grad_fn", "_cdata",
            "_backward_hooks", "_post_accumulate_grad_hooks")
_METHODS = ("size", "dim", "numel", "stride", "nelement", "element_size", "is_contiguous", "is_floating_point",
            "is_complex", "storage_offset", "get_device", "__len__", "ndimension", "is_signed", "__hash__",
            "is_inference", "is_shared", "is_pinned", "has_names", "_is_view", "__reduce_ex__", "__deepcopy__",
            "__getstate__", "__setstate__", "_is_zerotensor", "is_conj", "is_neg", "__dir__")
LOCAL: set = set()
for _n in _GETTERS:
    _d = getattr(torch.Tensor, _n, None)
    if _d is not None and hasattr(_d, "__get__"):
        LOCAL.add(_d.__get__)
for _n in _METHODS:
    _f = getattr(torch.Tensor, _n, None)
    if _f is not None:
        LOCAL.add(_f)
GRAD: Any = torch._C.TensorBase.__dict__["grad"]  # the .grad descriptor (typed as a Tensor in the stubs)
LOCAL.add(GRAD.__get__)

# Functions whose answer is a tensor's value: the controller does not have it.
VALUE_FUNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__array__,
               torch.Tensor.__complex__, torch.equal, torch.allclose, torch.Tensor.equal, torch.Tensor.allclose,
               torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage}


def value_error(func) -> RuntimeError:
    name = getattr(func, "__name__", repr(func))
    return RuntimeError(f"{name}() needs a distributed tensor's value, which lives on the ranks: fetch one rank's "
                        "shard with inspect(t) (or fetch_shard(t, **coords).get()), or compute it on the ranks "
                        "with a @remote function")


class Tensor(torch.Tensor):
    """A distributed tensor: one shard per rank of its mesh.  Made by torch calls inside
    ``with procs.activate():``; ops on it run on its mesh; read a shard with ``inspect(t)``::

        with procs.activate():
            t = torch.rand(3, 4)          # a Tensor: every rank has its own 3x4 shard
        u = t @ t.T                       # on t's mesh, activate() or not
        inspect(u, gpus=1)                # rank 1's shard, as a plain torch.Tensor
    """

    _mesh: Any
    _ref: int
    _r: Ref
    _meta: tuple
    _leaves: dict | None  # id -> the leaf handles its autograd graph reaches (None: needs no grad)
    _stream: Any  # the Stream it is used on (None: the main one)
    _access: Any  # None: read and write; else the borrows that limit it (``streams.Access``)

    @staticmethod
    def __new__(cls, meta: tuple, mesh, ref: int):
        size, stride, offset, dtype, device, requires_grad = meta
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, storage_offset=offset, dtype=dtype,
                                                device=device, requires_grad=requires_grad)
        t._mesh = mesh
        t._ref = ref
        t._r = Ref(ref)
        t._meta = meta
        t._leaves = None
        t._stream = state.stream
        t._access = None
        return t

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Reached outside activate() (inside it the recording mode answers first): as in
        # Monarch, an op on distributed tensors runs on their own mesh, active or not.
        if func in LOCAL:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        from .recorder import on_own_mesh

        return on_own_mesh(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} reached a distributed tensor's handle, which holds no values (its shards are on "
                           "the ranks); call torch functions on it (they run on its mesh), or fetch a shard with "
                           "inspect(t)")

    @property
    def mesh(self):
        """The mesh (a ``ProcMesh``, or the slice it was activated on) holding its shards."""
        return self._mesh.owner

    @property
    def ref(self) -> int:
        return self._ref

    def reduce(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None) -> Tensor:
        """This tensor reduced across mesh dims ``dims`` (one name, several, or all: None)
        with ``reduction`` (stack, sum, avg, product, min, max, band, bor, bxor)."""
        from .collective_calls import reduce

        return reduce(self, dims, reduction, scatter, mesh)

    def reduce_(self, dims, reduction: str = "sum", scatter: bool = False, mesh=None) -> Tensor:
        """``reduce`` in place."""
        from .collective_calls import reduce_

        return reduce_(self, dims, reduction, scatter, mesh)

    def to_mesh(self, mesh, stream=None) -> Tensor:
        """This tensor moved to another mesh (a slice of the same procs, or other procs)."""
        from .collective_calls import to_mesh

        return to_mesh(self, mesh)

    def slice_mesh(self, **coords) -> Tensor:
        from .meshes import slice_mesh

        return slice_mesh(self, **coords)

    def __reduce_ex__(self, protocol):
        # Passed to an actor's endpoint: it arrives as that rank's shard (sent batches first).
        return self._mesh.client.pickled_handle(self)

    def __deepcopy__(self, memo):
        raise RuntimeError("a distributed tensor cannot be deep-copied on the controller; make a copy on the "
                           "ranks inside activate() (t.clone())")

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        with DisableTorchFunctionSubclass():
            size = list(self.size())
            dtype, device, rg = self.dtype, self.device, self.requires_grad
        mesh = self._mesh
        grad = ", requires_grad=True" if rg else ""
        return f"monarch_kernel.Tensor(mesh={mesh.describe()}, shape={size}, dtype={dtype}, device={device}{grad})"

    def __format__(self, spec: str) -> str:
        return repr(self)

    def _repr_html_(self) -> str:
        import html

        return f"<code>{html.escape(repr(self))}</code>"


def meta_of(t: torch.Tensor, device=None, requires_grad=None) -> tuple:
    """The metadata tuple a handle is made from (and cached results are keyed by)."""
    return (tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype,
            t.device if device is None else device, t.requires_grad if requires_grad is None else requires_grad)


def fake_of(t: Tensor) -> torch.Tensor:
    """A meta tensor with a handle's metadata, for computing an op's results' metadata (a
    non-leaf when the handle needs grad but is not a leaf, so in-place ops behave)."""
    size, stride, offset, dtype, _device, rg = t._meta
    f = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    if offset:
        f = f.as_strided(size, stride, offset)
    if rg:
        f.requires_grad_(True)
        if t._leaves is not LEAF:
            with torch.enable_grad():
                f = f.clone()
    return f


LEAF: dict = {}  # the ``_leaves`` of a leaf that needs grad (it reaches only itself)
