"""How one transfer's bytes move once its transport is chosen (``transports.py`` chooses):
the transport's own function, GPU memory staged through host memory where the transport
is a CPU one, and this process's worker threads and issue order.  It never checks a range
or a handle's signature (``buffer.py`` does, before a transfer is started).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..runtime import config
from . import cuda_ipc, ibverbs, shm, tcp, wire
from .memory import Memory, as_memory
from .order import IssueOrder

if TYPE_CHECKING:
    from .buffer import Handle

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # the process that made _pool: a forked child makes its own
_pool_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """This process's worker threads for transfers (a forked child makes its own)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid() or _pool._shutdown:  # noqa: SLF001
            _pool, _pool_pid = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mk-data"), os.getpid()
        return _pool


_issue_order: IssueOrder | None = None


def issue_order() -> IssueOrder:
    """This process's transfers, each started after the earlier ones it conflicts with."""
    global _issue_order
    with _pool_lock:
        if _issue_order is None or _issue_order.pid != os.getpid():
            _issue_order = IssueOrder(lambda fn: executor().submit(fn))
        return _issue_order


# An inline copy in an event loop holds the loop for its duration: at most this many bytes.
INLINE_MAX = 1 << 20


def in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def bare_copy(h: Handle, via: str, op: wire.Op, mem: Memory) -> bool:
    """Whether the transfer is a copy with no round trip to the owner (transport says so)."""
    if via == "shm":
        return mem.device == "cpu" and shm.ready(h, op)
    return via == "cuda_ipc" and cuda_ipc.ready(h)


def transfer(h: Handle, key: bytes, op: wire.Op, mem: Memory, offset: int, timeout: float | None,
             via: str, threads: int = 1) -> None:
    """Move ``mem``'s bytes to or from the buffer ``h`` over ``via`` (a checked range)."""
    if via == "cuda_ipc":
        if mem.nbytes:
            cuda_ipc.transfer(h, key, op, _as_uint8(mem), offset, mem.nbytes, timeout)
        return
    if mem.device != "cpu":
        # GPU memory over a CPU transport: stage through host memory.
        staging = _torch().empty(mem.nbytes, dtype=_torch().uint8, pin_memory=False)
        if op == wire.Op.WRITE:
            staging.copy_(_as_uint8(mem))
        transfer(h, key, op, as_memory(staging, writable=True, what="staging"), offset, timeout, via, threads)
        if op == wire.Op.READ:
            _as_uint8(mem).copy_(staging)
        return
    if via == "ibverbs":
        ibverbs.transfer(h, key, op, mem, offset, timeout)
    elif via == "shm":
        shm.transfer(h, key, op, mem.view, offset, timeout, threads)
    else:
        tcp.transfer(h, key, op, mem.view, offset, timeout, config.tcp_streams())


def _as_uint8(m: Memory):
    """A flat uint8 tensor over the memory (a view, never a copy)."""
    torch = _torch()
    if m.tensor is not None:
        return m.tensor.reshape(-1).view(torch.uint8)
    return torch.frombuffer(m.view, dtype=torch.uint8) if m.nbytes else torch.empty(0, dtype=torch.uint8)


def device_copy(op: wire.Op, remote: Memory, local: Memory, offset: int) -> None:
    """A copy in the owner's process where either side is GPU memory."""
    window = _as_uint8(remote)[offset:offset + local.nbytes]
    if op == wire.Op.READ:
        _as_uint8(local).copy_(window)
    else:
        window.copy_(_as_uint8(local))


def _torch():
    return sys.modules.get("torch") or __import__("torch")
