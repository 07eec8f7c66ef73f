"""Which GPU a rank uses and which collective backend a group of ranks can use: nccl only
when every rank has a GPU of its own (NCCL refuses two ranks on one device: "Duplicate GPU
detected"), gloo otherwise (it reduces CUDA tensors too).  One rule for the tensor engine and
``setup_torch_distributed``.  It never imports torch until a rank asks for its own device.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def device_of(local_rank: int) -> str | None:
    """This process's CUDA device as ranks on this host pick it (``local_rank`` modulo the
    devices it sees, as ``setup_torch_distributed`` sets it), named by ``identity``; None
    without one."""
    torch = sys.modules.get("torch") or __import__("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return identity(local_rank % torch.cuda.device_count())


def identity(index: int) -> str:
    """CUDA device ``index`` of this process, named so that two processes that number it
    differently (``CUDA_VISIBLE_DEVICES``) agree: this host and the device's UUID."""
    torch = sys.modules.get("torch") or __import__("torch")
    from .net import hosts

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{hosts.host_key()}/{uuid if uuid is not None else index}"


def shared(devices: Sequence[str | None]) -> list[list[int]]:
    """The ranks (indices into ``devices``) that share a device, one list per shared device."""
    by: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        if d is not None:
            by.setdefault(d, []).append(i)
    return [ranks for ranks in by.values() if len(ranks) > 1]


def backend_for(devices: Sequence[str | None]) -> str:
    """``"nccl"`` when every rank has a device (``devices[i]``, None: none) and no two share
    one; ``"gloo"`` otherwise.

    Example::

        backend_for(["h/GPU-a", "h/GPU-b"])   # "nccl"
        backend_for(["h/GPU-a", "h/GPU-a"])   # "gloo": two ranks on one GPU
        backend_for([None, None])             # "gloo"
    """
    if devices and all(d is not None for d in devices) and not shared(devices):
        return "nccl"
    return "gloo"


def backend_for_counts(ranks_per_host: Sequence[int], devices_per_host: Sequence[int]) -> str:
    """The same rule from counts alone, for ranks placed ``local_rank % devices`` on each
    host: nccl only when every host has at least as many devices as ranks (and one)."""
    ok = all(d >= 1 and d >= r for r, d in zip(ranks_per_host, devices_per_host, strict=True))
    return "nccl" if ranks_per_host and ok else "gloo"


def nccl_refused(devices: Sequence[str | None]) -> str | None:
    """Why ``backend="nccl"`` cannot work for ranks with ``devices`` (what to pass instead),
    or None when it can."""
    missing = [i for i, d in enumerate(devices) if d is None]
    if missing:
        return (f"backend='nccl' needs a GPU on every rank, and ranks {missing} have none "
                "(torch.cuda.is_available() is False there); use backend='gloo', or None to "
                "pick nccl only where every rank has one")
    both = shared(devices)
    if both:
        return (f"backend='nccl' needs a GPU of its own per rank, and ranks {both[0]} share one "
                "(NCCL refuses that: 'Duplicate GPU detected'); use backend='gloo' (it reduces CUDA "
                "tensors too), or None to pick it, or spawn at most as many ranks per host as it "
                "has GPUs")
    return None


def release_after_oom(exc: BaseException) -> bool:
    """After a CUDA out-of-memory error (``exc`` or one in its chain), let go of what the
    failed code held (the locals of its finished frames: its report is already taken) and
    give this process's cached GPU memory back to the device, so ranks sharing it are not
    starved by a reservation nobody uses (torch keeps what it reserved until
    ``empty_cache()``).  True when it did."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 8 and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if oom is None or not any(isinstance(x, oom) for x in chain):
        return False
    import traceback

    for x in chain:
        traceback.clear_frames(x.__traceback__)
    torch.cuda.empty_cache()
    return True
