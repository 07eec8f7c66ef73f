"""The rank's half of ``setup_torch_distributed`` and ``device_mesh``: the process group and
the ``DeviceMesh`` this process is part of, built, rebuilt and aborted here.

Runs on ranks.  torch is imported only inside these functions, when the controller asks for
a group; importing this module imports nothing of torch.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from .layout import RankEnv

_lock = threading.Lock()
_state: dict[str, Any] = {"device_mesh": None, "spec": None}


def current_device_mesh():
    """The ``torch.distributed.device_mesh.DeviceMesh`` this rank belongs to, as built by
    ``procs.device_mesh(("dp", "tp"))`` in the controller::

        mesh = current_device_mesh()
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    """
    mesh = _state["device_mesh"]
    if mesh is None:
        raise RuntimeError("no device mesh on this rank yet: call  procs.device_mesh(('dp', 'tp'))  in the "
                           "controller (the notebook) first; after %mesh restart call it again")
    return mesh


def is_initialized() -> bool:
    """Whether this process has a default process group (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def has_gpu(local_rank: int) -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def init_group(backend: str, env: RankEnv, timeout_s: float | None) -> str:
    """(Re)build the default process group: a group this process had (healthy, or broken
    by a peer's death) is destroyed first, so the same call rebuilds after a restart."""
    import datetime

    import torch.distributed as dist

    with _lock:
        _drop_group()
        if backend == "nccl":
            import torch

            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        kwargs: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "init_method": "env://"}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, **kwargs)
        return dist.get_backend()


def build_device_mesh(device_type: str, shape: tuple, names: tuple) -> tuple:
    """``init_device_mesh`` over the default group; the mesh becomes ``current_device_mesh()``.
    Returns this rank's coordinate in it."""
    from torch.distributed.device_mesh import init_device_mesh

    with _lock:
        _state["device_mesh"] = None
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        _state["device_mesh"], _state["spec"] = mesh, (device_type, tuple(shape), tuple(names))
        return tuple(mesh.get_coordinate() or ())


def abort_group(reason: str = "") -> bool:
    """Abort this process's default group (from any thread): a collective blocked on it in
    another thread raises at once instead of waiting for the group's timeout.  True if there
    was a group.  Called when a peer died, or when an SPMD script failed or was interrupted
    on this rank (its peers would otherwise wait for it in their next collective)."""
    if not is_initialized():
        _state["device_mesh"] = None
        return False
    import torch.distributed as dist

    _state["device_mesh"] = None
    try:
        dist.distributed_c10d._abort_process_group()  # noqa: SLF001  (torch's own abort, public in all but name)
    except (AttributeError, RuntimeError, ValueError):
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError):
            pass
    if reason:
        print(f"process group aborted: {reason}", file=sys.stderr, flush=True)
    return True


def _drop_group() -> None:
    _state["device_mesh"] = None
    if not is_initialized():
        return
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        abort_group()
