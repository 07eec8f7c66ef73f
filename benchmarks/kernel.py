"""W7: a ``%%mesh`` cell ``x = 1`` on 4 ranks through a real monarch kernel, driven by a
jupyter_client BlockingKernelClient: execute request to idle status, median of 50 (10
warm-up), in ms."""

from __future__ import annotations

import statistics
import sys
import time

from ._util import log, p99


def _run(kc, code: str, timeout: float = 60) -> dict:
    msg_id = kc.execute(code)
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            break
    return kc.get_shell_msg(timeout=timeout)["content"]


def w7() -> dict:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import start_new_kernel

    from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=60)
    try:
        assert _run(kc, "procs = %mesh spawn -n 4")["status"] == "ok"
        samples = []
        for i in range(60):
            t = time.perf_counter()
            reply = _run(kc, "%%mesh\nx = 1")
            if i >= 10:
                samples.append(time.perf_counter() - t)
            assert reply["status"] == "ok", reply
        _run(kc, "%mesh stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    out = {"W7_mesh_cell_ms": {"median": round(statistics.median(samples) * 1e3, 2),
                               "p99": round(p99(samples) * 1e3, 2)}}
    log(f"W7: {out}")
    return out
