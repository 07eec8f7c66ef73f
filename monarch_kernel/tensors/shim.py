"""What fills ``actor/tensor_shim.py``'s slot: the tensor engine as the actor layer calls it.
Each call imports what it needs then, so importing the tensors package stays cheap (no
torch) on ranks and in the kernel."""

from __future__ import annotations


class ActorSide:
    """``actor.tensor_shim.Tensors`` over this package."""

    def __init__(self) -> None:
        self._contexts: tuple | None = None  # controller.client's (destination, pinned), once asked

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

    def send(self, fn, args, kwargs, port, selection: str) -> None:
        from .controller.remote import send

        send(fn, args, kwargs, port, selection)

    def pinned_for(self, mesh_id: str) -> _Pinned:
        if self._contexts is None:
            from .controller.client import destination, pinned

            self._contexts = (destination, pinned)
        return _Pinned(mesh_id, *self._contexts)


class _Pinned:
    """While a call's arguments are pickled: the proc mesh they go to, and the list of the
    distributed tensors among them (``controller.client``'s context variables).  A class,
    not a generator: it runs on every actor call once tensors are imported."""

    __slots__ = ("mesh_id", "destination", "pinned", "handles", "tokens")

    def __init__(self, mesh_id: str, destination, pinned):
        self.mesh_id, self.destination, self.pinned = mesh_id, destination, pinned
        self.handles: list = []
        self.tokens: tuple = ()

    def __enter__(self) -> list:
        self.tokens = (self.destination.set(self.mesh_id), self.pinned.set(self.handles))
        return self.handles

    def __exit__(self, *exc) -> None:
        dest_token, pin_token = self.tokens
        self.destination.reset(dest_token)
        self.pinned.reset(pin_token)
