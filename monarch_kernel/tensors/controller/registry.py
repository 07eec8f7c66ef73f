"""The controller's tensor clients, one per proc mesh: made on a mesh's first
``activate()`` (its engines spawned then), forgotten when it stops, and what the kernel
lists of them (``%mesh tensors``, the Mesh panel)."""

from __future__ import annotations

import threading
from typing import Any

from .backend import EngineBackend
from .client import MeshClient
from .client import describe as describe_handle
from .meshes import TensorMesh

_CLIENTS: dict[str, Any] = {}  # proc mesh id -> its MeshClient
_LOCK = threading.Lock()
_MESHES: dict[tuple, object] = {}  # (client, ranks, extent) -> its TensorMesh


def tensor_client(procs):
    """The proc mesh's tensor client, its engines spawned on first use."""
    with _LOCK:
        client = _CLIENTS.get(procs.ref.id)
        if client is None or procs.stopped:
            if client is not None:
                _close(client)
            client = _CLIENTS[procs.ref.id] = MeshClient(EngineBackend(procs))
    return client


def forget(mesh_id: str) -> None:
    """The proc mesh stopped: its client stops sending (and its flush thread ends)."""
    with _LOCK:
        client = _CLIENTS.pop(mesh_id, None)
    if client is not None:
        _close(client)


def _close(client) -> None:
    client.close()
    backend = client.backend
    if isinstance(backend, EngineBackend):
        backend.close()


def live_tensors() -> dict[str, list[dict]]:
    """``{mesh name: [{shape, dtype, device, bytes}, ...]}``: the live distributed tensors
    (``%mesh tensors``; bytes are each rank's)."""
    out: dict[str, list[dict]] = {}
    for client in list(_CLIENTS.values()):
        rows = client.listing()
        if rows:
            out[client.name] = rows
    return out


def live_handles() -> dict[str, list]:
    """``{mesh name: [handle, ...]}``: the live distributed tensors themselves, for a caller
    that tells them apart (``%mesh tensors`` names each by the notebook variable holding it);
    ``describe(handle)`` gives a row of ``live_tensors``."""
    out: dict[str, list] = {}
    for client in list(_CLIENTS.values()):
        handles = client.live()
        if handles:
            out[client.name] = handles
    return out


def describe(handle) -> dict:
    """``{shape, dtype, device, bytes}`` of one distributed tensor (bytes: each rank's)."""
    return describe_handle(handle)


def tensor_totals(mesh_id: str) -> tuple[int, int]:
    """``(count, bytes per rank)`` of the live distributed tensors of proc mesh ``mesh_id``
    (the Mesh panel); ``(0, 0)`` before its first ``activate()``."""
    client = _CLIENTS.get(mesh_id)
    if client is None:
        return 0, 0
    rows = client.listing()
    return len(rows), sum(r["bytes"] for r in rows)


def tensor_mesh(procs):
    """The ``TensorMesh`` of ``procs`` (a whole proc mesh or a slice of one): the same one
    each time for the same ranks, so handles compare their meshes by identity."""
    client = tensor_client(procs)
    key = (id(client), procs.shape.ranks, procs.shape.extent)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.client is not client:
        mesh = _MESHES[key] = TensorMesh(client, procs.shape, procs)
    return mesh
