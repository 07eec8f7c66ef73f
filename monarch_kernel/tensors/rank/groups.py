"""Process groups for one activated mesh, each made by its own members alone.

A group is a gloo (CPU tensors) or nccl (CUDA tensors) backend built straight over the
activation's rendezvous (``MeshStore``: keys the controller keeps, reached through the
runtime's signed messages, so no port is opened for them), under a key spelled from the group's
members, backend and stream.  No other group uses that key, so groups can be made lazily,
at first use, in any order: ranks outside a group take no part, and no two ranks need to
agree on the order groups are made in.  torch's default group is neither made nor touched,
so a user's own ``init_process_group`` lives beside these groups.  Nothing here sets
torchrun's environment variables.  torch is imported only once a group is made.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

from ...runtime import config, gpus
from ..rendezvous import Rendezvous


class Groups:
    """The process groups made over one rendezvous in this process, shared by every
    ``Collectives`` over it (a mesh's and its slices' views)."""

    _shared: dict[Rendezvous, Groups] = {}
    _shared_lock = threading.Lock()

    def __init__(self, rendezvous: Rendezvous):
        from .store import MeshStore

        self.rendezvous = rendezvous
        self.timeout = datetime.timedelta(seconds=config.collective_timeout())
        self.store = MeshStore(rendezvous.keeper, self.timeout)
        self._groups: dict[tuple, Any] = {}
        self._making: dict[tuple, threading.Lock] = {}
        self._backends: dict[tuple, str] = {}  # members -> the backend of their CUDA tensors
        self._published: str | None = None  # this rank's device, once told to the others
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def shared(cls, rendezvous: Rendezvous) -> Groups:
        with cls._shared_lock:
            got = cls._shared.get(rendezvous)
            if got is None or got._closed:
                got = cls._shared[rendezvous] = cls(rendezvous)
            return got

    def key(self, *parts) -> str:
        return "/".join([self.rendezvous.prefix, *map(str, parts)])

    def group(self, members: tuple[int, ...], me: int, backend: str, stream: str = "default"):
        """The ``backend`` group of ``members`` (proc-mesh ranks, in group order) on
        ``stream``, made on first use; ``me`` is this process's rank, one of ``members``."""
        k = (backend, stream, members)
        with self._lock:
            self._check_open()
            pg = self._groups.get(k)
            if pg is not None:
                return pg
            making = self._making.setdefault(k, threading.Lock())
        with making:  # one group at a time per key; others (other streams) are made meanwhile
            with self._lock:
                self._check_open()
                pg = self._groups.get(k)
            if pg is None:
                pg = self._make(members, members.index(me), backend, stream)
                with self._lock:
                    self._groups[k] = pg
            return pg

    def backend(self, members: tuple[int, ...], me: int, device: Any) -> str:
        """The backend ``members`` move tensors on ``device`` with: gloo for CPU ones; for
        CUDA ones nccl only when no two members' tensors sit on one GPU (``gpus.backend_for``:
        NCCL refuses that), learned once per set of members through the store, where each
        member tells its device.  Every member computes the same answer."""
        if device.type != "cuda" or len(members) < 2:
            return backend_for(device.type)
        with self._lock:
            got = self._backends.get(members)
        if got is not None:
            return got
        import torch

        mine = gpus.identity(device.index if device.index is not None else torch.cuda.current_device())
        if self._published != mine:
            self.store.set(self.key("device", me), mine)
            self._published = mine
        devices = [mine if m == me else self.store.get(self.key("device", m)).decode() for m in members]
        got = gpus.backend_for(devices)
        with self._lock:
            self._backends[members] = got
        return got

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("these collectives were closed (the mesh was deactivated or a rank "
                               "failed); activate the mesh again for new ones")

    def _make(self, members: tuple[int, ...], index: int, backend: str, stream: str):
        import torch.distributed as dist

        store = dist.PrefixStore(self.key("group", backend, stream, ",".join(map(str, members))), self.store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = self.timeout
            # gloo's own listener (one per group, an ephemeral port): the loopback when every
            # rank runs on one host; else MONARCH_KERNEL_BIND, or what the host's name resolves to.
            host = "127.0.0.1" if self.rendezvous.local else (config.bind_address() or "")
            device = (dist.ProcessGroupGloo.create_device(hostname=host) if host
                      else dist.ProcessGroupGloo.create_default_device())
            opts._devices = [device]
            return dist.ProcessGroupGloo(store, index, len(members), opts)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, index, len(members), opts)
        raise ValueError(f"no process group backend {backend!r}: gloo (CPU tensors) or nccl (CUDA tensors)")

    def close(self) -> None:
        """Drop every group (a collective blocked on one fails); later use raises."""
        with self._lock:
            self._closed = True
            groups, self._groups = list(self._groups.values()), {}
        for pg in groups:
            try:
                pg.abort()
            except (AttributeError, RuntimeError):
                pass
        with self._shared_lock:
            if self._shared.get(self.rendezvous) is self:
                del self._shared[self.rendezvous]


def backend_for(device_type: str) -> str:
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    raise TypeError(f"collectives move CPU tensors (over gloo) and CUDA tensors (over nccl), not {device_type} "
                    "ones; move the tensor with .cpu() or .cuda() first")
