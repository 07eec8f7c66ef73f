"""W10 (hang): a rank SIGSTOPped inside a gloo collective on 4 ranks, under ``%mesh watchdog T
--then abort``, to ``HangError`` in the cell, through a real monarch kernel; how far past T
that is (the target: within 5 s); and after SIGCONT, how long the next ``%%mesh`` cell takes
(the mesh kept).  Beside the same run's W2 floor (a raw pyzmq round trip), for scale."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from ._util import log
from .floors import pyzmq_rtt

T = 5.0
LOOP = ("%%mesh\nimport torch, torch.distributed as dist\nt = torch.ones(1)\nfor i in range(10**8):\n"
        "    dist.all_reduce(t)\n    t.fill_(1)\n    if i == 50:\n        print('looping', flush=True)")


def _wait_for(kc, msg_id: str, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id and needle in msg["content"].get("text", ""):
            return
    raise TimeoutError(f"no {needle!r} from the cell within {timeout:g} s")


def _idle(kc, msg_id: str, timeout: float) -> dict:
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            while True:  # the shell reply to this cell (an earlier one may still be queued)
                reply = kc.get_shell_msg(timeout=timeout)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return reply["content"]


def w10_hang() -> dict:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import start_new_kernel

    from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

    floor = pyzmq_rtt()[0]  # its round trip (median and p99, µs)
    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=60)
    stopped_pid = None
    try:
        for code in ("procs = %mesh spawn -n 4", "from monarch_kernel.spmd import setup_torch_distributed\n"
                     "setup_torch_distributed(procs)", f"%mesh watchdog {T:g} --then abort"):
            assert _idle(kc, kc.execute(code), 120)["status"] == "ok", code
        msg_id = kc.execute("print('pids', [r['pid'] for r in procs.rank_states()])")
        pids: list[int] = []
        while not pids:
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and "pids" in msg["content"].get("text", ""):
                pids = [int(p) for p in re.findall(r"\d+", msg["content"]["text"])]
        _idle(kc, msg_id, 60)
        msg_id = kc.execute(LOOP)
        _wait_for(kc, msg_id, "looping", 120)
        stopped_pid = pids[1]
        os.kill(stopped_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        reply = _idle(kc, msg_id, 120)
        hang_s = time.monotonic() - t0
        assert reply.get("ename") == "HangError", reply
        os.kill(stopped_pid, signal.SIGCONT)
        stopped_pid = None
        t1 = time.monotonic()
        after = _idle(kc, kc.execute("%%mesh\nx = 1"), 120)
        next_cell_s = time.monotonic() - t1
        assert after["status"] == "ok", after
        out = {"W10_hang_to_hang_error_s": {
            "watchdog_T_s": T, "stop_to_hang_error_s": round(hang_s, 2), "beyond_T_s": round(hang_s - T, 2),
            "target_beyond_T_s": 5.0, "next_cell_after_sigcont_s": round(next_cell_s, 2),
            "W2_floor_pyzmq_rtt_us": floor}}
        log(f"W10 hang: {out}")
        return out
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        try:
            _idle(kc, kc.execute("%mesh stop"), 60)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
