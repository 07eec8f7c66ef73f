"""The controller's ``setup_torch_distributed(procs)`` and ``device_mesh(procs, ...)``: a
process group on every rank of a mesh, and a ``DeviceMesh`` over it whose dims are the
mesh's own, rebuilt by calling again after ``%mesh restart``.  Free functions of the mesh,
as Monarch's ``monarch.spmd``: the actor layer's ``ProcMesh`` knows nothing of torch.

Runs in the controller; the ranks' half is ``rank/group.py``.  It never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime import counted, gpus
from .env import SETUP_TIMEOUT_S, MeshRecord, check_alive, record, setup_torch_elastic_env

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DeviceMeshHandle:
    """The controller's view of the ``DeviceMesh`` built on every rank of ``procs``: its dim
    names and shape.  On a rank, ``current_device_mesh()`` is the mesh itself.

    Example::

        mesh = device_mesh(procs, ("dp", "tp"))
        print(mesh)                           # DeviceMesh<{'dp': 2, 'tp': 2} cpu on 'procs'>
    """

    procs: object
    names: tuple
    shape: tuple
    device_type: str

    def rebuild(self) -> DeviceMeshHandle:
        """Build it again (after ``%mesh restart`` and ``setup_torch_distributed(procs)``)."""
        return device_mesh(self.procs, self.names, mesh_shape=self.shape, device_type=self.device_type)

    def __repr__(self) -> str:
        dims = ", ".join(f"'{n}': {s}" for n, s in zip(self.names, self.shape, strict=True))
        return f"DeviceMesh<{{{dims}}} {self.device_type} on '{getattr(self.procs, 'name', '?')}'>"


def setup_torch_distributed(procs, backend: str | None = None, *, timeout: float | None = None) -> str:
    """torchrun's variables on every rank (``setup_torch_elastic_env``), then the default
    process group, initialised on every rank; returns the backend.  ``backend=None``: nccl
    when every rank has a GPU of its own, gloo otherwise (ranks sharing a GPU, as on a
    one-GPU workstation, get gloo: NCCL refuses them); ``backend="nccl"`` where it cannot
    work raises at once, saying what to pass.  Calling it again (after ``%mesh restart``)
    rebuilds the group with the same ranks, and the device mesh if one was built.

    Example::

        procs = this_host().spawn_procs(per_host={"gpus": 4})
        setup_torch_distributed(procs)          # 'gloo' here; 'nccl' with a GPU per rank
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose 'gloo', 'nccl', or None (nccl when every rank has a "
                         "GPU of its own)")
    check_alive(procs)
    rec = record(procs)
    flat = rec.env.flatten("rank")
    if backend != "gloo":
        devices = list(flat.device.call().get(timeout=SETUP_TIMEOUT_S).values())
        if backend is None:
            backend = gpus.backend_for(devices)
        else:
            why = gpus.nccl_refused(devices)
            if why is not None:
                raise RuntimeError(why)
    setup_torch_elastic_env(procs)
    got = flat.init_process_group.call(backend, timeout).get(timeout=SETUP_TIMEOUT_S + (timeout or 0))
    rec.backend, rec.stale = backend, False
    if rec.device_mesh is not None:
        _build(procs, rec, rec.device_mesh)
    return next(iter(got.values()))


def device_mesh(procs, names=None, *, mesh_shape=None, device_type: str | None = None) -> DeviceMeshHandle:
    """Build a ``torch.distributed.device_mesh.DeviceMesh`` on every rank and return its
    handle; on each rank ``current_device_mesh()`` is the mesh.  Its dims are the ProcMesh's
    (``{"hosts": 2, "gpus": 4}`` with ``names=("dp", "tp")`` is a 2x4 mesh named dp, tp;
    ``names=None`` keeps the ProcMesh's names); ``mesh_shape=(2, 2)`` reshapes a mesh whose
    dims do not match.  Sets the process group up first if it is not (or a rank was replaced).

    Example::

        setup_torch_distributed(procs)
        mesh = device_mesh(procs, ("dp", "tp"))
    """
    dims = dict(procs.extent)
    names = tuple(dims) if names is None else tuple(names)
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"device_mesh takes dim names, e.g. ('dp', 'tp'); got {names!r}")
    if mesh_shape is None:
        if len(names) != len(dims):
            raise ValueError(f"mesh '{procs.name}' has dims {dims}, so device_mesh needs {len(dims)} names, not "
                             f"{len(names)} ({names!r}); spawn it with per_host={{'dp': 2, 'tp': 2}} or pass "
                             f"mesh_shape=(2, 2)")
        mesh_shape = tuple(dims.values())
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if len(mesh_shape) != len(names):
        raise ValueError(f"mesh_shape={mesh_shape} has {len(mesh_shape)} dims for {len(names)} names {names!r}")
    total = 1
    for s in mesh_shape:
        total *= s
    if total != len(procs):
        raise ValueError(f"mesh_shape={mesh_shape} holds {counted(total, 'rank')}; "
                         f"mesh '{procs.name}' has {len(procs)}")
    check_alive(procs)
    rec = record(procs)
    if rec.backend is None or rec.stale:
        setup_torch_distributed(procs, None if rec.backend is None else rec.backend)
    if device_type is None:
        device_type = "cuda" if rec.backend == "nccl" else "cpu"
    handle = DeviceMeshHandle(procs, names, mesh_shape, device_type)
    _build(procs, rec, handle)
    rec.device_mesh = handle
    return handle


def _build(procs, rec: MeshRecord, handle: DeviceMeshHandle) -> None:
    flat = rec.env.flatten("rank")
    flat.init_device_mesh.call(handle.device_type, handle.shape, handle.names).get(timeout=SETUP_TIMEOUT_S)
