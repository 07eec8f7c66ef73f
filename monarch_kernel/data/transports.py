"""Which transports this process can use, why not, and which one a transfer takes.

Listed best first: ``ibverbs`` (an RDMA NIC), ``cuda_ipc`` (GPU memory on one host), ``shm``
(one host), ``tcp`` (anywhere).  Per pair, one host prefers ``cuda_ipc`` for GPU memory and
``shm`` otherwise (a memcpy beats a loop through the NIC); across hosts ``ibverbs`` where both
ends have a device, else ``tcp``.  ``MONARCH_KERNEL_DATA_TRANSPORT`` forces one; a forced transport
that cannot serve a pair is an error rather than a silent fallback.
"""

from __future__ import annotations

import os
import sys

from ..runtime import config, hosts
from .errors import TransferError

NAMES = ("ibverbs", "cuda_ipc", "shm", "tcp")


def _ibverbs() -> tuple[bool, str]:
    from . import ibverbs

    return ibverbs.is_available()


def _cuda() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to this process (torch.cuda.is_available() is False)"
    return True, f"{torch.cuda.device_count()} CUDA device(s); peers on this host map GPU memory directly"


def _shm() -> tuple[bool, str]:
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        return False, "/dev/shm is missing or not writable"
    return True, ("peers on this host copy straight out of the owner's memory: torch CPU tensors "
                  "are moved into shared memory when registered; other memory streams over a "
                  "local socket")


def transports() -> list[dict]:
    """Every transport, best first: ``{"name", "available", "reason"}``."""
    out = []
    for name, probe in (("ibverbs", _ibverbs), ("cuda_ipc", _cuda), ("shm", _shm)):
        ok, why = probe()
        out.append({"name": name, "available": ok, "reason": why})
    out.append({"name": "tcp", "available": True,
                "reason": "direct rank-to-rank TCP, authenticated with the job key; works between any hosts"})
    forced = config.data_transport()
    if forced:
        for t in out:
            t["forced"] = t["name"] == forced
    return out


def choose(h, local_device: str = "cpu") -> str:
    """The transport a transfer between this process and ``h``'s owner uses."""
    same_host = h.host == hosts.host_key()
    forced = config.data_transport()
    if forced:
        if forced not in NAMES:
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT={forced!r} is not a transport; "
                                f"use one of {', '.join(NAMES)}")
        if forced in ("shm", "cuda_ipc") and not same_host:
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT={forced} but buffer {h.name!r} is "
                                f"on another host ({h.owner}); unset it or use tcp")
        if forced == "ibverbs" and not (h.ib and _ibverbs()[0]):
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT=ibverbs but {_ibverbs()[1]}")
        if forced == "cuda_ipc" and not h.device.startswith("cuda"):
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT=cuda_ipc but buffer {h.name!r} is CPU memory")
        return forced
    if same_host and h.device.startswith("cuda") and "torch" in sys.modules and _cuda()[0]:
        return "cuda_ipc"
    if same_host and _shm()[0]:
        return "shm"  # a memcpy beats a loop through the NIC
    if h.ib and h.device == "cpu" and _ibverbs()[0]:
        return "ibverbs"
    return "tcp"
