"""``Collectives``: one rank's side of reductions over mesh dims and of moving tensors between
ranks of a mesh (``to_mesh``), given local tensors and returning local tensors.

It knows the activated mesh's dims, the proc-mesh rank at each of its points, and this
process's rank; it never sees the executor or the controller.  Groups per set of dims are
made by their members at first use (``groups.py``), so nothing here depends on torch's
default group or on torchrun's variables.  A call is collective over its group: every
member must make it, in the same order as the others (the controller's order of ops), or
on another ``stream`` (a name: each stream has groups of its own, so two threads may
reduce at once).  A collective that fails (a peer died) leaves its group unusable: close
these collectives and make new ones over a rendezvous with a fresh prefix.

    coll = Collectives({"hosts": 2, "gpus": 2}, ranks=[0, 1, 2, 3], rank=me, store=rendezvous)
    total = coll.reduce(t, "gpus", "sum")            # all_reduce over gpus
    shard = coll.reduce(t, "gpus", "sum", scatter=True)
    moved = coll.transfer(t, [(0, 2), (1, 3)], like=t)   # hosts=0 -> hosts=1
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..rendezvous import Rendezvous
from . import buffers, reductions
from .groups import Groups
from .links import Links
from .peer_failed import flag as flag_word
from .peer_failed import raise_if_flagged
from .transfer import Transfers


class Collectives:
    """Reductions and transfers of one rank over one mesh.

    ``dims``: the mesh's ``{dim: size}`` in order (or ``(dim, size)`` pairs); ``ranks``: the
    proc-mesh rank at each point, row-major (a ``Shape``'s ``ranks``); ``rank``: this
    process's proc-mesh rank; ``store``: the activation's ``Rendezvous``;
    ``transfer``: ``"direct"``, ``"gloo"`` or None (the best per pair; the same on every rank).
    """

    def __init__(self, dims: Mapping[str, int] | Sequence[tuple[str, int]], ranks: Sequence[int], rank: int,
                 store: Rendezvous, *, transfer: str | None = None):
        items = list(dims.items() if isinstance(dims, Mapping) else dims)
        self._labels = tuple(str(k) for k, _ in items)
        self._sizes = tuple(int(v) for _, v in items)
        self._ranks = tuple(int(r) for r in ranks)
        n = 1
        for s in self._sizes:
            n *= s
        if n != len(self._ranks):
            raise ValueError(f"{len(self._ranks)} ranks do not fill a mesh of dims {dict(items)} ({n} points)")
        if len(set(self._ranks)) != len(self._ranks):
            raise ValueError(f"a mesh's ranks are distinct; got {list(self._ranks)}")
        if rank not in self._ranks:
            raise ValueError(f"rank {rank} is not in this mesh (its ranks are {list(self._ranks)}); make "
                             "Collectives only on the mesh's own ranks")
        self._rank = int(rank)
        self._index = self._ranks.index(self._rank)
        self._store = store
        self._groups = Groups.shared(store)
        self._transfers = Transfers(self._groups, self._rank, transfer)

    # ------------------------------------------------------------ the mesh, as this rank sees it

    @property
    def dims(self) -> dict[str, int]:
        return dict(zip(self._labels, self._sizes, strict=True))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def point(self) -> dict[str, int]:
        """This rank's coordinates (``{"hosts": 1, "gpus": 0}``)."""
        return dict(zip(self._labels, self._coords(self._index), strict=True))

    def submesh(self, dims: Mapping[str, int] | Sequence[tuple[str, int]], ranks: Sequence[int]) -> Collectives:
        """The collectives of a slice of this mesh (this rank among its ``ranks``), sharing
        this one's store and groups."""
        return Collectives(dims, ranks, self._rank, self._store, transfer=self._transfers.mode)

    def members(self, dims: str | Sequence[str] | None = None) -> tuple[int, ...]:
        """The proc-mesh ranks of this rank's group over ``dims`` (None or ``()``: all), in
        group order: the points that share this rank's coordinates on the other dims,
        row-major over ``dims``."""
        wanted = self._dims_arg(dims)
        mine = self._coords(self._index)
        axes = [range(s) if label in wanted else [c]
                for label, s, c in zip(self._labels, self._sizes, mine, strict=True)]
        return tuple(self._ranks[self._flat(combo)] for combo in itertools.product(*axes))

    # ------------------------------------------------------------ reductions

    def reduce(self, local: Any, dims: str | Sequence[str] | None = None, reduction: str = "sum",
               scatter: bool = False, *, out: Any = None, stream: str = "default", failed: int | None = None) -> Any:
        """Monarch's ``t.reduce(dims, reduction, scatter)`` on this rank's shard ``local``;
        returns this rank's shard of the result (a new tensor, or ``out`` filled)::

            sum over dims            -> all_reduce        (same shape)
            stack                    -> all_gather        (new outer dim of the group's size)
            sum, scatter=True        -> reduce_scatter    (outer dim, of the group's size, split)
            stack, scatter=True      -> all_to_all        (same shape)

        ``failed``: this rank's input failed (on that rank): it takes part (``local``: zeros)
        so that every peer raises ``PeerFailed`` at once rather than waiting for it.
        """
        result = self._reduce(local, dims, reduction, scatter, False, stream, failed)
        if out is not None:
            out.copy_(result)
            return out
        return result

    def reduce_(self, local: Any, dims: str | Sequence[str] | None = None, reduction: str = "sum",
                scatter: bool = False, *, stream: str = "default", failed: int | None = None) -> Any:
        """``reduce`` into ``local`` itself (for shapes that do not change: an elementwise
        reduction, or stack with scatter); returns ``local``."""
        return self._reduce(local, dims, reduction, scatter, True, stream, failed)

    def _reduce(self, local, dims, reduction: str, scatter: bool, inplace: bool, stream: str, failed: int | None):
        import torch
        import torch.distributed as dist

        if not isinstance(local, torch.Tensor):
            raise TypeError(f"reduce takes a torch.Tensor, not {type(local).__name__}")
        members = self.members(dims)
        n = len(members)
        reductions.check(reduction, scatter, inplace, len(self._dims_arg(dims)), local, n)
        backend = self._groups.backend(members, self._rank, local.device)
        if backend == "gloo" and local.device.type == "cuda":
            # Ranks sharing a GPU (NCCL refuses them): reduce a host copy over gloo.
            got = self._reduce(local.detach().cpu(), dims, reduction, scatter, False, stream, failed)
            if inplace:
                local.detach().copy_(got)
                return local
            return got.to(local.device)
        pg = self._groups.group(members, self._rank, backend, stream) if n > 1 else None
        plain = local.detach()  # values only: a reduction is no autograd op
        src = plain.contiguous()  # plain itself when it is contiguous
        flag: Any = None
        flag_work = None
        if pg is not None:  # whether some member's input failed: beside the data, on the same group
            flag = flag_word(failed, local.device)
            flag_work = pg.allreduce([flag], dist.ReduceOp.MAX)
        if reduction == "stack":
            result = _all_to_all(pg, src) if scatter else _all_gather(pg, src, n)
        else:
            op = reductions.native_op(backend, reduction, local.dtype)
            if scatter:
                if op is not None and pg is not None:
                    result = _reduce_scatter(pg, src, op)
                else:
                    result = reductions.combine(_all_to_all(pg, src), reduction)
            elif op is not None:
                result = src if inplace or src is not plain else _copy(src)  # src: already a copy
                if pg is not None:
                    pg.allreduce([result], op).wait()
            else:
                result = reductions.combine(_all_gather(pg, src, n), reduction)
        if flag_work is not None:
            flag_work.wait()
            if failed is None:  # the failed member itself knows already
                raise_if_flagged(flag, members)
        if inplace:
            if result is not plain:
                plain.copy_(result)
            return local
        return result

    # ------------------------------------------------------------ moving tensors between ranks

    def transfer(self, local: Any, pairs: Sequence[tuple[int, int]], like: Any = None, *,
                 stream: str = "default", failed: int | None = None) -> Any:
        """Move tensors point to point: for each ``(source, destination)`` pair of
        proc-mesh ranks, the source's ``local`` arrives at the destination.  Every rank named
        in ``pairs`` calls it with the same pairs; a source passes its tensor, a destination
        ``like`` (a tensor, real, fake or meta, of the shape and dtype it receives) and gets
        the tensor back; a rank that only sends gets None.  A source may send to several
        destinations; a destination receives once.  CPU tensors between ranks of one host
        are copied straight out of the source's memory (``direct``), others go over gloo;
        CUDA tensors over nccl (``transfer_path`` says which).  ``failed``: this source's
        input failed on that rank (``local``: a stand-in of its shape); its destinations
        raise ``PeerFailed`` at once."""
        return self._transfers.run(local, [(int(s), int(d)) for s, d in pairs], like, stream, failed)

    def transfer_path(self, peer: int) -> str:
        """How CPU tensors move between this rank and ``peer``: ``"direct"`` (one copy, on
        one host) or ``"gloo"``."""
        return "direct" if self._transfers.direct_with(int(peer)) else "gloo"

    def close(self) -> None:
        """Drop the groups and links of this rendezvous, in this process: what waits on one fails."""
        Links.close_for(self._store)
        self._groups.close()

    # ------------------------------------------------------------ helpers

    def _dims_arg(self, dims) -> tuple[str, ...]:
        if dims is None:
            return self._labels
        wanted = (dims,) if isinstance(dims, str) else tuple(dims)
        if not wanted:
            return self._labels
        for d in wanted:
            if d not in self._labels:
                raise KeyError(f"the mesh has no dim {d!r}; its dims are "
                               f"{', '.join(self._labels) or 'none'}")
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"dims {wanted} names a dim twice; name each once")
        return wanted

    def _coords(self, index: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self._sizes):
            out.append(index % s)
            index //= s
        return tuple(reversed(out))

    def _flat(self, coords) -> int:
        flat = 0
        for c, s in zip(coords, self._sizes, strict=True):
            flat = flat * s + c
        return flat

    def __repr__(self) -> str:
        return f"Collectives<rank {self._rank} at {self.point} of {self.dims}>"


def _as_bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def _copy(src: Any) -> Any:
    out = buffers.empty(src.shape, src.dtype, src.device)
    out.copy_(src)
    return out


def _all_gather(pg, src: Any, n: int) -> Any:
    out = buffers.empty((n, *src.shape), src.dtype, src.device)
    if pg is None:
        out[0].copy_(src)
    else:
        pg._allgather_base(_as_bytes(out), _as_bytes(src)).wait()
    return out


def _all_to_all(pg, src: Any) -> Any:
    out = buffers.empty(src.shape, src.dtype, src.device)
    if pg is None:
        out.copy_(src)
    else:
        pg.alltoall_base(_as_bytes(out), _as_bytes(src), [], []).wait()
    return out


def _reduce_scatter(pg, src: Any, op) -> Any:
    import torch.distributed as dist

    out = buffers.empty(src.shape[1:], src.dtype, src.device)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = op
    pg._reduce_scatter_base(out.reshape(-1), src.reshape(-1), opts).wait()
    return out
