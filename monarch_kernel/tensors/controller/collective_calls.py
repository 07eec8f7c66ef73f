"""``reduce``, ``reduce_`` and ``to_mesh`` on the controller: the result's metadata, checked
at once, and one ``COLLECTIVE`` message whose request the ranks' ``Collectives``
(``tensors/rank/collectives.py``: process groups per set of mesh dims, point-to-point moves)
carries out.

Example::

    with procs.activate():
        total = t.reduce("gpus", "sum")            # every rank holds the sum over gpus
        stacked = t.reduce(("hosts", "gpus"), "stack")
"""

from __future__ import annotations

import torch

from ..messages import COLLECTIVE, Collective
from .borrows import check_use
from .meshes import TensorMesh, state
from .tensor import Tensor

REDUCTIONS = ("stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def _dims(mesh: TensorMesh, dims) -> tuple:
    if dims is None:
        return mesh.labels
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    for d in dims:
        if d not in mesh.labels:
            raise ValueError(f"the mesh {mesh.describe()} has no dimension {d!r}; its dimensions are "
                             f"{', '.join(mesh.labels) or 'none'}")
    return dims


def _mesh(t: Tensor, mesh, writes: bool = False) -> TensorMesh:
    if type(t) is not Tensor:
        raise TypeError(f"reduce takes a distributed tensor, not {type(t).__name__}")
    if t._stream is not state.stream or t._access is not None:
        check_use(t, state.stream, "reduce_()" if writes else "reduce()", writes)
    return t._mesh  # as in Monarch: a reduction runs on its tensor's mesh, whichever is active


def _meta(t: Tensor, mesh: TensorMesh, dims: tuple, reduction: str, scatter: bool) -> tuple:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
    n = 1
    for d in dims:
        n *= mesh.sizes[mesh.labels.index(d)]
    size, _stride, _off, dtype, device, rg = t._meta
    if reduction in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"reduction {reduction!r} needs an integer or bool tensor, not {dtype}")
    if reduction == "stack":
        size = (n, *size) if not scatter else size
    elif scatter:
        if not size or size[0] % n:
            raise ValueError(f"reduce(scatter=True) over {n} ranks needs a first dim divisible by {n}; "
                             f"the tensor's shape is {list(size)}")
        size = (size[0] // n, *size[1:])
    return (tuple(size), _contiguous(size), 0, dtype, device, rg)


def _contiguous(size) -> tuple:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _like(t: Tensor) -> tuple:
    return (tuple(t._meta[0]), t._meta[3], str(t._meta[4]))


def reduce(t: Tensor, dims=None, reduction: str = "sum", scatter: bool = False, mesh=None) -> Tensor:
    """``t`` reduced across mesh dims ``dims`` (a name, several, or None: all); with
    ``scatter`` each rank keeps its part of the result.

    Example::

        with procs.activate():
            t = torch.ones(3)
            total = monarch.reduce(t, "gpus")     # sum over the ranks: 4.0 each on 4 ranks
    """
    m = _mesh(t, mesh)
    dims = _dims(m, dims)
    meta = _meta(t, m, dims, reduction, scatter)
    client = m.client
    ref = client.new_ref()
    out = Tensor(meta, m, ref)
    client.adopt(out)
    req = Collective("reduce", t._ref, ref, m.labels, m.sizes, m.ranks, dims, reduction, scatter, like=_like(t))
    client.record((COLLECTIVE, req), [ref], m.rank_set, torch.is_grad_enabled())
    return out


def reduce_(t: Tensor, dims=None, reduction: str = "sum", scatter: bool = False, mesh=None) -> Tensor:
    """``reduce`` into ``t`` itself (its shape must not change: no stack, no scatter).

    Example::

        with procs.activate():
            t = torch.ones(3)
            monarch.reduce_(t, "gpus", reduction="avg")
    """
    m = _mesh(t, mesh, writes=True)
    dims = _dims(m, dims)
    if reduction == "stack" or scatter:
        raise ValueError("reduce_ keeps the tensor's shape: use reduce() for stack or scatter")
    _meta(t, m, dims, reduction, scatter)
    req = Collective("reduce", t._ref, t._ref, m.labels, m.sizes, m.ranks, dims, reduction, scatter, like=_like(t))
    m.client.record((COLLECTIVE, req), [], m.rank_set, torch.is_grad_enabled())
    return t


def to_mesh(t: Tensor, mesh) -> Tensor:
    """``t`` moved to ``mesh`` (a ProcMesh, or a slice, of the same proc mesh, with the same
    dims' sizes): rank i of the destination gets the shard of rank i of the source.

    Example::

        u = monarch.to_mesh(t, procs.slice(gpus=slice(2, 4)))   # t's values, now on ranks 2-3
    """
    from .meshes import TensorMesh as _TM

    if type(t) is not Tensor:
        raise TypeError(f"to_mesh takes a distributed tensor, not {type(t).__name__}")
    if t._stream is not state.stream or t._access is not None:
        check_use(t, state.stream, "to_mesh()", False)
    src = t._mesh
    dest = mesh if isinstance(mesh, _TM) else _tensor_mesh_of(mesh, src)
    if dest.client is not src.client:
        raise NotImplementedError("to_mesh between different proc meshes: move it within one proc mesh's slices")
    if dest.sizes != src.sizes:
        raise ValueError(f"to_mesh needs a mesh of the same sizes: {src.describe()} -> {dest.describe()}")
    client = src.client
    ref = client.new_ref()
    out = Tensor(t._meta, dest, ref)
    client.adopt(out)
    both = frozenset(src.ranks) | frozenset(dest.ranks)
    req = Collective("to_mesh", t._ref, ref, src.labels, src.sizes, src.ranks, dest_ranks=dest.ranks,
                     like=_like(t))
    client.record((COLLECTIVE, req), [ref], None if len(both) == client.world else both, torch.is_grad_enabled())
    return out


def _tensor_mesh_of(procs, like: TensorMesh) -> TensorMesh:
    return TensorMesh(like.client, procs.shape, procs)
