"""``endpoint.rref(...)``, the controller's half: the endpoint runs on every rank of the
actors' mesh and its result stays there as distributed tensors, whose shapes are known at
once (the rank's half is ``rank/engine.py``'s ``keep_result``)."""

from __future__ import annotations

from ...actor.adverbs import Endpoint
from ...actor.endpoint import RREF_METHOD
from .meshes import active
from .registry import tensor_mesh


def rref(mesh, method: str, propagate, procs, args, kwargs):
    """``mesh.method.rref(*args, **kwargs)``, its result's shapes given by ``propagate``;
    ``procs``: the actors' proc mesh (None for a mesh this process did not spawn)."""
    from .remote import promise

    tm = active()
    if tm is None or tm.client.backend.mesh_id != mesh.proc_ref.id:
        if procs is None:
            raise ValueError("rref needs the actors' proc mesh active: `with procs.activate():`")
        tm = tensor_mesh(procs.slice(**{}) if not len(mesh.shape.extent) else procs)
    result, out = promise(tm, propagate, args, kwargs)
    Endpoint(mesh, RREF_METHOD).broadcast(tm.client.backend.key, method, out, args, kwargs)
    return result
