"""W12 ("panel"): what the Mesh panel costs the kernel, through a real monarch kernel whose
comm a client opens as JupyterLab does (on a subshell): panel updates per second while the
kernel is idle (target 0) and while a ``%%mesh`` cell keeps 4 ranks busy (printing a line
every 50 ms and computing), over 10 s each."""

from __future__ import annotations

import sys
import time
import uuid

from ._util import log

COMM_TARGET = "monarch_kernel.panel"
WINDOW_S = 10.0


def _control(kc, msg_type: str, content: dict) -> dict:
    msg = kc.session.msg(msg_type, content)
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]


def _count(kc, comm_id: str, seconds: float, until_idle: str | None = None) -> tuple[int, float]:
    """Panel messages on iopub over ``seconds`` (or until cell ``until_idle`` finishes)."""
    n, t0 = 0, time.monotonic()
    while True:
        left = t0 + seconds - time.monotonic()
        if until_idle is None and left <= 0:
            return n, time.monotonic() - t0
        try:
            msg = kc.get_iopub_msg(timeout=max(0.05, min(left, 0.5)) if until_idle is None else 0.5)
        except Exception:  # noqa: BLE001  (queue.Empty)
            continue
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            n += 1
        if (until_idle is not None and msg["parent_header"].get("msg_id") == until_idle
                and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"):
            return n, time.monotonic() - t0


def _run(kc, code: str) -> None:
    msg_id = kc.execute(code)
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return


def w12() -> dict:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import start_new_kernel

    from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=60)
    try:
        subshell = _control(kc, "create_subshell_request", {})["subshell_id"]
        comm_id = uuid.uuid4().hex
        msg = kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": COMM_TARGET,
                                           "data": {"action": "hello"}})
        msg["header"]["subshell_id"] = subshell
        kc.shell_channel.send(msg)
        _run(kc, "procs = %mesh spawn -n 4")
        _count(kc, comm_id, 1.5)  # read (and leave out) the spawn's updates
        idle, idle_s = _count(kc, comm_id, WINDOW_S)
        cell = kc.execute("%%mesh\nimport time\nt0 = time.monotonic()\nwhile time.monotonic() - t0 < 10:\n"
                          "    sum(range(20000)); print('step', flush=True); time.sleep(0.05)")
        busy, busy_s = _count(kc, comm_id, 0, until_idle=cell)
        _run(kc, "%mesh stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    out = {"W12_panel_msgs_per_s": {"idle": round(idle / idle_s, 2), "busy_4_ranks": round(busy / busy_s, 2),
                                    "idle_window_s": round(idle_s, 1), "busy_window_s": round(busy_s, 1)}}
    log(f"W12: {out}")
    return out
