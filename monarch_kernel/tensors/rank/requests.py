"""What a rank's executor does with a ``COLLECTIVE`` message: the reduction or the move it
asks for, carried out by ``Collectives`` over the mesh (or slice) it names, reading its
input from the executor's refs and binding its output there.

One ``Collectives`` per mesh the requests name, all over the rendezvous the controller
made when it spawned the tensor engines (``TensorEngine``'s ``store``), so a
mesh and its slices share their process groups.
"""

from __future__ import annotations

from typing import Any

from ..messages import Collective, Poisoned
from .collectives import Collectives


class CollectiveRequests:
    def __init__(self, executor):
        self.executor = executor
        self._meshes: dict[tuple, Collectives] = {}

    def _over(self, labels: tuple, sizes: tuple, ranks: tuple) -> Collectives:
        key = (tuple(labels), tuple(sizes), tuple(ranks))
        c = self._meshes.get(key)
        if c is None:
            store = self.executor.store
            if store is None:
                raise RuntimeError("this tensor engine has no rendezvous: reductions need the engines the "
                                   "controller spawns with procs.activate()")
            c = self._meshes[key] = Collectives(list(zip(labels, sizes, strict=True)), ranks, self.executor.rank,
                                                store)
        return c

    def _input(self, ref: int) -> Any:
        value = self.executor.env.get(ref)
        if isinstance(value, Poisoned):
            raise RuntimeError(f"its input failed on rank {value.rank} ({value.what}):\n{value.traceback}")
        if value is None:
            raise KeyError(f"no tensor {ref} on rank {self.executor.rank} (it was deleted)")
        return value

    def run(self, req: Collective, stream: str = "default") -> None:
        """Carry out ``req`` on ``stream`` (each stream has process groups of its own)."""
        ex = self.executor
        if req.kind == "reduce":
            if ex.rank not in req.ranks:
                return
            c = self._over(req.labels, req.sizes, req.ranks)
            local = ex.env.get(req.source)
            failed = local if type(local) is Poisoned else None
            local = _stand_in(req) if failed is not None and req.like is not None else self._input(req.source)
            dims = tuple(req.dims) or None
            origin = None if failed is None else failed.rank
            if req.out == req.source:
                c.reduce_(local, dims, req.reduction, req.scatter, stream=stream, failed=origin)
            else:
                result = c.reduce(local, dims, req.reduction, req.scatter, stream=stream, failed=origin)
                ex.env[req.out] = result if failed is None else failed
        elif req.kind == "to_mesh":
            pairs = list(zip(req.ranks, req.dest_ranks, strict=True))
            mine = req.ranks if ex.rank in req.ranks else req.dest_ranks
            if ex.rank not in mine:
                return
            c = self._over(req.labels, req.sizes, mine)
            local, failed = None, None
            if ex.rank in req.ranks:
                value = ex.env.get(req.source)
                if type(value) is Poisoned and req.like is not None:
                    failed, local = value, _stand_in(req)
                else:
                    local = self._input(req.source)
            like = None
            if req.like is not None:
                import torch

                like = torch.empty(req.like[0], dtype=req.like[1], device="meta")
            got = c.transfer(local, pairs, like, stream=stream, failed=None if failed is None else failed.rank)
            if ex.rank in req.dest_ranks:
                ex.env[req.out] = got if failed is None else failed
        else:
            raise ValueError(f"unknown collective {req.kind!r}")

    def close(self) -> None:
        for c in self._meshes.values():
            c.close()
        self._meshes.clear()


def _stand_in(req: Collective) -> Any:
    """Zeros of the input's shape, for a rank whose input failed: it takes part anyway,
    saying so, so that its peers fail now rather than after a timeout."""
    import torch

    assert req.like is not None  # the controller sends it with every reduce and move
    return torch.zeros(req.like[0], dtype=req.like[1], device=req.like[2])
