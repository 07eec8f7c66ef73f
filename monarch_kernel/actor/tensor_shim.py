"""The actor layer's one way to distributed tensors, which sit above it (``tensors/``): a
typed slot (``Tensors``) that the tensors package fills when it is imported.

actor/ never imports tensors/ (tests/system/test_layering.py).  ``forget`` and ``pinned_for``
ask only a filled slot: where no tensors module was imported there is no tensor to forget
or to pin.  ``tensors()``, for what needs the engine (``procs.activate()``,
``endpoint.rref``, an rref's result on a rank), first imports the package by name while
the slot is empty: the one import from below, kept here alone (the layering test reads
import statements, not this), as Monarch's ``tensor_engine_shim`` keeps its own.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .actor import Actor
    from .actor_mesh import ActorMesh
    from .proc_mesh import ProcMesh

PACKAGE = "monarch_kernel.tensors"  # its __init__ calls install()


class Tensors(Protocol):
    """What the actor layer asks of the tensor engine."""

    def tensor_mesh(self, procs: ProcMesh) -> Any:
        """The ``TensorMesh`` of ``procs``, its engines spawned on first use (``activate()``)."""

    def rank_tensor(self, procs: ProcMesh, dim: str) -> Any:
        """A distributed 0-dim tensor: each rank's index along ``dim``."""

    def rank_tensors(self, procs: ProcMesh) -> dict:
        """``{dim: rank_tensor(dim)}`` for every dim."""

    def rref(self, mesh: ActorMesh, method: str, propagate: Callable, procs: ProcMesh | None, args,
             kwargs) -> Any:
        """``mesh.method.rref(*args, **kwargs)``: the result stays on the ranks as distributed
        tensors, shaped by ``propagate``; ``procs``: the actors' proc mesh, where known."""

    def keep_result(self, actor: Actor, key: str, method: str, out, args, kwargs) -> None:
        """On a rank: run ``method`` and keep its result as the tensors ``out`` of engine ``key``."""

    def forget(self, mesh_id: str) -> None:
        """Proc mesh ``mesh_id`` stopped: its tensor client stops."""

    def send(self, fn, args, kwargs, port, selection: str) -> None:
        """``send(remote_fn, ...)``: ``fn`` runs on every rank of the active mesh."""

    def pinned_for(self, mesh_id: str) -> AbstractContextManager[list]:
        """While arguments for proc mesh ``mesh_id`` are pickled: a list of the distributed
        tensors among them, to keep alive until the call is answered."""


_slot: Tensors | None = None


def install(tensors: Tensors) -> None:
    """Called by the tensors package when it is imported."""
    global _slot
    _slot = tensors


def tensors() -> Tensors:
    """The tensor engine, importing the tensors package if nothing has yet."""
    if _slot is None:
        importlib.import_module(PACKAGE)
    if _slot is None:
        raise RuntimeError(f"{PACKAGE} was imported but did not install itself in actor/tensor_shim.py")
    return _slot


def forget(mesh_id: str) -> None:
    """Proc mesh ``mesh_id`` stopped: its tensor client, if tensors were used, stops."""
    if _slot is not None:
        _slot.forget(mesh_id)


def pinned_for(mesh_id: str) -> AbstractContextManager[list]:
    """``Tensors.pinned_for``; an empty list where no tensors were imported."""
    return _slot.pinned_for(mesh_id) if _slot is not None else contextlib.nullcontext([])
