"""Which transports this process can use, why not, and which one a transfer takes.  It must
never move bytes nor silently fall back from a transport the user forced
(``MONARCH_KERNEL_DATA_TRANSPORT``) to another.
"""

from __future__ import annotations

import sys

from ..runtime import config, hosts
from . import cuda_ipc, ibverbs, shm
from .errors import TransferError

# Listed best first: ibverbs (an RDMA NIC), cuda_ipc (GPU memory on one host), shm (one
# host), tcp (anywhere).  Per pair, one host prefers cuda_ipc for GPU memory and shm
# otherwise (a memcpy beats a loop through the NIC); across hosts ibverbs where both ends
# have a device, else tcp.  A forced transport that cannot serve a pair is an error.

NAMES = ("ibverbs", "cuda_ipc", "shm", "tcp")


def transports() -> list[dict]:
    """Every transport, best first: ``{"name", "available", "reason"}``.

    Example::

        for t in transports():
            print(t["name"], t["available"], t["reason"])
    """
    out = []
    for name, probe in (("ibverbs", ibverbs.is_available), ("cuda_ipc", cuda_ipc.is_available),
                        ("shm", shm.is_available)):
        ok, why = probe()
        out.append({"name": name, "available": ok, "reason": why})
    out.append({"name": "tcp", "available": True,
                "reason": "direct rank-to-rank TCP, authenticated with the job key; works between any hosts"})
    forced = config.data_transport()
    if forced:
        for t in out:
            t["forced"] = t["name"] == forced
    return out


def is_ibverbs_available() -> bool:
    """Monarch's name: whether this process can move bytes through an RDMA NIC (ibverbs).
    ``transports()`` says why not.

    Example::

        if not is_ibverbs_available():
            print([t["reason"] for t in transports() if t["name"] == "ibverbs"])
    """
    return ibverbs.is_available()[0]


def get_rdma_backend() -> str:
    """Monarch's name and values: ``"ibverbs"`` where transfers use an RDMA NIC, ``"tcp"``
    where they use this project's NIC-free transports (shm on one host, tcp across hosts;
    Monarch says ``"tcp"`` for its own fallback), ``"none"`` where no transfer can work
    (``MONARCH_KERNEL_DATA_TRANSPORT`` forces ibverbs without a NIC, or names no transport).

    Example::

        if get_rdma_backend() == "ibverbs":
            print("RDMA NIC in use")
    """
    forced = config.data_transport()
    nic = is_ibverbs_available()
    if forced == "ibverbs":
        return "ibverbs" if nic else "none"
    if forced and forced not in NAMES:
        return "none"
    return "ibverbs" if nic and not forced else "tcp"


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
        if forced == "ibverbs" and not (h.ib and ibverbs.is_available()[0]):
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT=ibverbs but {ibverbs.is_available()[1]}")
        if forced == "cuda_ipc" and not h.device.startswith("cuda"):
            raise TransferError(f"MONARCH_KERNEL_DATA_TRANSPORT=cuda_ipc but buffer {h.name!r} is CPU memory")
        return forced
    if same_host and h.device.startswith("cuda") and "torch" in sys.modules and cuda_ipc.is_available()[0]:
        return "cuda_ipc"
    if same_host and shm.is_available()[0]:
        return "shm"  # a memcpy beats a loop through the NIC
    if h.ib and h.device == "cpu" and ibverbs.is_available()[0]:
        return "ibverbs"
    return "tcp"
