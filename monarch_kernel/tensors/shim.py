"""What fills ``actor/tensor_shim.py``'s slot: the tensor engine as the actor layer calls it.
Each call imports what it needs then, so importing the tensors package stays cheap (no
torch) on ranks and in the kernel."""

from __future__ import annotations

import contextlib


class ActorSide:
    """``actor.tensor_shim.Tensors`` over this package."""

    def tensor_mesh(self, procs):
        from .controller.registry import tensor_mesh

        return tensor_mesh(procs)

    def rank_tensor(self, procs, dim: str):
        from .controller.registry import tensor_mesh
        from .controller.remote import rank_tensor

        return rank_tensor(tensor_mesh(procs), dim)

    def rank_tensors(self, procs) -> dict:
        from .controller.registry import tensor_mesh
        from .controller.remote import rank_tensors

        return rank_tensors(tensor_mesh(procs))

    def rref(self, mesh, method: str, propagate, procs, args, kwargs):
        from .controller.rref import rref

        return rref(mesh, method, propagate, procs, args, kwargs)

    def keep_result(self, actor, key: str, method: str, out, args, kwargs) -> None:
        from .rank.engine import keep_result

        keep_result(actor, key, method, out, args, kwargs)

    def forget(self, mesh_id: str) -> None:
        from .controller.registry import forget

        forget(mesh_id)

    @contextlib.contextmanager
    def pinned_for(self, mesh_id: str):
        from .controller.client import destination, pinned

        handles: list = []
        dest_token, pin_token = destination.set(mesh_id), pinned.set(handles)
        try:
            yield handles
        finally:
            destination.reset(dest_token)
            pinned.reset(pin_token)
