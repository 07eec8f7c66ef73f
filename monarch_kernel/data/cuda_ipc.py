"""The ``cuda_ipc`` transport: GPU memory between processes on one host, copied device to
device through torch's CUDA IPC handles, owner half and reader half.  It must never hand an
IPC handle over TCP (it means nothing on another host) nor stage the bytes through the CPU.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from . import client, liveness, wire
from .errors import BufferDropped, ForgedHandle, OwnerGone, TransferError
from .memory import Memory

_probed: dict[int, tuple[bool, str]] = {}  # pid -> the answer: asked once per process


def is_available() -> tuple[bool, str]:
    """Whether this process sees a CUDA device (asked of torch once per process)."""
    got = _probed.get(os.getpid())
    if got is None:
        got = _probed[os.getpid()] = _probe()
    return got


def _probe() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to this process (torch.cuda.is_available() is False)"
    return True, f"{torch.cuda.device_count()} CUDA device(s); peers on this host map GPU memory directly"


# ---------------------------------------------------------------- owner side


def serve_map(sock: socket.socket, mem: Memory, via: str) -> None:
    """Answer a checked ``MAP`` of CUDA memory with a fresh IPC handle per peer (torch counts
    the processes using the storage), or ``NOT_SHARED`` over TCP or where torch refuses."""
    handle = _cuda_handle(mem) if via == "unix" else None
    wire.send_reply(sock, wire.Status.OK if handle else wire.Status.NOT_SHARED,
                    json.dumps({"cuda": handle}).encode())


def _cuda_handle(mem: Memory):
    """torch's CUDA IPC handle for the tensor's storage, for peers on this host."""
    t = mem.tensor
    storage = t.untyped_storage()
    try:
        handle = storage._share_cuda_()
    except RuntimeError:
        return None
    offset = t.data_ptr() - storage.data_ptr()
    return [_jsonable(x) for x in handle], offset


def _jsonable(x):
    return {"b": x.hex()} if isinstance(x, bytes) else x


# ---------------------------------------------------------------- reader side


_cuda: dict[tuple, Any] = {}  # (owner, buffer, token) -> the owner's storage, opened once


def forget(h) -> None:
    """Let go of ``h``'s storage in this process (dropped, or its owner gone)."""
    _cuda.pop((h.instance, h.id, h.token), None)


def ready(h) -> bool:
    """Whether a transfer on ``h`` needs no round trip: opened before, still live."""
    if (h.instance, h.id, h.token) not in _cuda:
        return False
    w = liveness.watch(h.instance)
    return w is not None and w.live(h.id)


def transfer(h, key: bytes, op: wire.Op, target, offset: int, nbytes: int, timeout: float | None) -> None:
    """Open the owner's CUDA storage through its IPC handle (once), then copy on the device,
    on the caller's current stream, and wait for that stream alone (not the whole device)."""
    import torch

    k = (h.instance, h.id, h.token)

    def run():
        with client.Connection(h, "unix", key, timeout) as sock:
            if k not in _cuda:
                info = json.loads(client.request(sock, h, wire.Op.MAP, 0, 0) or b"{}")
                if not info.get("cuda"):
                    raise TransferError(f"buffer {h.name!r} has no CUDA IPC handle (it is not CUDA memory)")
                handle, base = info["cuda"]
                args = [bytes.fromhex(x["b"]) if isinstance(x, dict) else x for x in handle]
                storage = torch.UntypedStorage._new_shared_cuda(*args)
                remote = torch.empty(0, dtype=torch.uint8, device=storage.device)
                _cuda[k] = remote.set_(storage, base, (h.size,))
            client.request(sock, h, wire.Op.CHECK, offset, nbytes)  # alive, not dropped, in range
        liveness.obtain(h, key, timeout)  # later transfers skip the CHECK

    try:
        if not ready(h):
            client.guarded(h, run)
    except (BufferDropped, OwnerGone, ForgedHandle):
        forget(h)
        liveness.forget(h.instance)
        raise
    window = _cuda[k][offset:offset + nbytes]
    stream = torch.cuda.current_stream(window.device)
    with torch.cuda.stream(stream):
        if op == wire.Op.READ:
            target.copy_(window, non_blocking=True)
        else:
            window.copy_(target, non_blocking=True)
    stream.synchronize()
