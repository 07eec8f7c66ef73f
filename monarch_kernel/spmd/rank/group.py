"""The rank's half of ``setup_torch_distributed`` and ``device_mesh``: the process group and
the ``DeviceMesh`` this process is part of, built, rebuilt and aborted here.

Runs on ranks.  torch is imported only inside these functions, when the controller asks for
a group; importing this module imports nothing of torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from typing import Any

from ...runtime import config
from ..layout import RankEnv
from . import master_store

log = logging.getLogger(__name__)
ABORTED_OP_S = config.seconds("aborted_group_op")
_lock = threading.Lock()
_state: dict[str, Any] = {"device_mesh": None, "spec": None}
_sockets: list[tuple[int, int]] = []  # (fd, inode) of the TCP connections gloo opened for this rank's groups


def current_device_mesh():
    """The ``torch.distributed.device_mesh.DeviceMesh`` this rank belongs to, as built by
    ``device_mesh(procs, ("dp", "tp"))`` in the controller::

        mesh = current_device_mesh()
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    """
    mesh = _state["device_mesh"]
    if mesh is None:
        raise RuntimeError("no device mesh on this rank yet: call  device_mesh(procs, ('dp', 'tp'))  in the "
                           "controller (the notebook) first; after %mesh restart call it again")
    return mesh


def is_initialized() -> bool:
    """Whether this process has a default process group (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def init_group(backend: str, env: RankEnv, timeout_s: float | None, store: Any = None) -> str:
    """(Re)build the default process group: a group this process had (healthy, or broken
    by a peer's death) is destroyed first, so the same call rebuilds after a restart.
    ``store``: a client of the store at ``MASTER_ADDR:MASTER_PORT`` already connected
    (``elastic_run`` connects it itself, to know when an abort can still reach it)."""
    import datetime

    import torch.distributed as dist

    with _lock:
        _drop_group()
        if backend == "nccl":
            import torch

            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        kwargs: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size}
        if store is None:
            kwargs["init_method"] = "env://"
            before_init()
        else:
            kwargs["store"] = store
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        with recording_sockets():
            dist.init_process_group(backend, **kwargs)
        made()
        return dist.get_backend()


def set_timeout(timeout_s: float) -> None:
    """Give the default group's collectives ``timeout_s`` (it may have been made with another)."""
    import datetime

    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))  # noqa: SLF001  (torch's own setter)


def build_device_mesh(device_type: str, shape: tuple, names: tuple) -> tuple:
    """``init_device_mesh`` over the default group; the mesh becomes ``current_device_mesh()``.
    Returns this rank's coordinate in it."""
    from torch.distributed.device_mesh import init_device_mesh

    with _lock:
        _state["device_mesh"] = None
        with recording_sockets():
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
    if dist.get_backend() == "gloo":
        _fail_late_operations(dist)
    _shut_sockets()
    master_store.group_gone()
    try:
        dist.distributed_c10d._abort_process_group()  # noqa: SLF001  (torch's own abort, public in all but name)
    except (AttributeError, RuntimeError, ValueError):
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError):
            pass
    if reason:
        log.warning("process group aborted: %s", reason)
    return True


def _fail_late_operations(dist) -> None:
    """Give the gloo groups' operations posted from now on ``ABORTED_OP_S``: one posted by
    another thread just as the connections are shut (a main thread let go of a SIGSTOP races
    the watchdog's abort) misses their end-of-file one time in twenty, and would otherwise
    wait out the group's timeout (30 minutes); torch's abort of a gloo group does not end it.
    Operations already running keep their timeout: the shut ends most of them, but a send a
    stopped rank had under way can wait on in gloo until that timeout (the self-healing guide)."""
    import datetime

    c10d = dist.distributed_c10d
    short = datetime.timedelta(seconds=ABORTED_OP_S)
    for pg in list(c10d._world.pg_names):  # noqa: SLF001  (torch's registry of groups)
        with contextlib.suppress(RuntimeError, ValueError, AssertionError):
            c10d._set_pg_timeout(short, pg)  # noqa: SLF001  (torch's own setter)


def before_init() -> None:
    """On RANK 0, before a default group is made with torchrun's variables: the store they
    name is served here (again, when a destroyed group took the last one with it)."""
    if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if addr and port.isdigit():
            master_store.ensure(addr, int(port))


def made() -> None:
    """The default group was just made, over the store at ``MASTER_ADDR:MASTER_PORT`` (which
    then lives as long as the group)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if addr and port.isdigit():
        master_store.group_made(addr, int(port))


def gone() -> None:
    """The default group was destroyed: the store it was made over goes too."""
    master_store.group_gone()


@contextlib.contextmanager
def recording_sockets():
    """Remember the TCP sockets opened while the block runs (a group's, as it is made), so
    that ``abort_group`` can shut them: torch's abort of a gloo group leaves its connections
    up, and an operation queued on it then waits forever; a shut connection fails it at
    once, here and on every peer (whose side reads end-of-file)."""
    before = set(_tcp_sockets().values())
    try:
        yield
    finally:
        _sockets.extend((fd, ino) for fd, ino in _tcp_sockets().items() if ino not in before)


def _shut_sockets() -> None:
    now = _tcp_sockets()
    for fd, ino in _sockets:
        if now.get(fd) != ino:
            continue  # closed since (its number may have been reused: leave that one alone)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
    _sockets.clear()


def _tcp_sockets() -> dict[int, int]:
    """``{fd: inode}`` of this process's connected TCP sockets (Linux: /proc), leaving out
    listening ones (gloo's listener must stay: shutting it ends the process) and those of
    the rendezvous store (``MASTER_PORT``), which torch's own threads use."""
    store = os.environ.get("MASTER_PORT", "")
    store_port = f"{int(store):04X}" if store.isdigit() else None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) <= 9 or cols[3] == "0A":  # 0A: LISTEN
                        continue
                    if store_port and store_port in (cols[1].rsplit(":", 1)[-1], cols[2].rsplit(":", 1)[-1]):
                        continue
                    inodes.add(int(cols[9]))
        except OSError:
            continue
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in inodes:
            out[int(name)] = int(link[8:-1])
    return out


def _drop_group() -> None:
    _state["device_mesh"] = None
    if not is_initialized():
        _sockets.clear()
        return
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        abort_group()
    gone()
    _sockets.clear()
