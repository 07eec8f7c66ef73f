"""W12 ("panel"): what the Mesh panel costs the kernel, through a real monarch kernel whose
comm a client opens as JupyterLab does (on a subshell): panel updates per second while the
kernel is idle (target 0) and while a ``%%mesh`` cell keeps 4 ranks busy (printing a line
every 50 ms and computing), over 10 s each.

Then the scale case (``SCALE_RANKS`` ranks, 256; ``MONARCH_KERNEL_PANEL_SCALE=0`` skips it):
a mesh over ``status.SUMMARY_OVER`` ranks is summarised, so each update carries counts and
the ranks that are not idle only.  Updates per second and bytes per update (the comm
message's JSON) while idle, while 3 of its ranks print every 50 ms, while every rank is busy
(all listed), and the full table (Show all ranks); and the kernel's time to build one state,
summarised and expanded."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from ._util import log

COMM_TARGET = "monarch_kernel.panel"
WINDOW_S = 10.0
SCALE_RANKS = int(os.environ.get("MONARCH_KERNEL_PANEL_SCALE", "256"))
SCALE_WINDOW_S = 5.0
SCALE_START_BY_S = 50.0  # the job has 120 s (benchmarks/__main__.py); the scale case needs ~60 s on 2 cores


def _control(kc, msg_type: str, content: dict) -> dict:
    msg = kc.session.msg(msg_type, content)
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]


def _count(kc, comm_id: str, seconds: float, until_idle: str | None = None, sizes: list | None = None
           ) -> tuple[int, float]:
    """Panel messages on iopub over ``seconds`` (or until cell ``until_idle`` finishes); each
    state's size in bytes (its JSON) appended to ``sizes``."""
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
            if sizes is not None and msg["content"]["data"].get("type") == "state":
                sizes.append(len(json.dumps(msg["content"]["data"])))
        if (until_idle is not None and msg["parent_header"].get("msg_id") == until_idle
                and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"):
            return n, time.monotonic() - t0


def _run(kc, code: str) -> str:
    """Run a cell; its stdout."""
    msg_id, out = kc.execute(code), []
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)


def _request(kc, subshell: str, comm_id: str, **data) -> None:
    """A panel request on the comm (its reply and the state it causes arrive on iopub)."""
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"type": "request", **data}})
    msg["header"]["subshell_id"] = subshell
    kc.shell_channel.send(msg)


def _mean(xs: list) -> int | None:
    return round(sum(xs) / len(xs)) if xs else None


# In the kernel: how long the panel takes to build one state of the big mesh, summarised and expanded.
STATE_COST = """\
import json as _j, time as _t
_feed = get_ipython().magics_manager.registry['MeshMagics'].session.panel
def _cost(expanded):
    _feed.view.expanded = set(expanded)
    _feed.state()
    t0 = _t.perf_counter()
    for _ in range(10):
        _feed.state()
    return round((_t.perf_counter() - t0) / 10 * 1e3, 2)
_costs = {"summarised_ms": _cost([]), "expanded_ms": _cost(["big"])}
_feed.view.expanded = set()
print(_j.dumps(_costs))
"""


def _scale(kc, subshell: str, comm_id: str, n: int) -> dict:
    t0 = time.monotonic()
    _run(kc, f"big = %mesh spawn -n {n} --name big")
    spawn_s = time.monotonic() - t0
    _count(kc, comm_id, 2.0)  # the spawn's updates
    idle, idle_s = _count(kc, comm_id, SCALE_WINDOW_S)
    summary: list[int] = []
    _request(kc, subshell, comm_id, action="refresh", id=1)
    _count(kc, comm_id, 1.0, sizes=summary)
    loop = f"t0 = time.monotonic()\nwhile time.monotonic() - t0 < {SCALE_WINDOW_S}:\n"
    few: list[int] = []
    cell = kc.execute("%%mesh --ranks 0-2\nimport time\n" + loop + "    print('step', flush=True); time.sleep(0.05)")
    few_n, few_s = _count(kc, comm_id, 0, until_idle=cell, sizes=few)
    every: list[int] = []
    cell = kc.execute("%%mesh\nimport time\n" + loop + "    time.sleep(0.05)")
    all_n, all_s = _count(kc, comm_id, 0, until_idle=cell, sizes=every)
    full: list[int] = []
    _request(kc, subshell, comm_id, action="table", id=2, mesh="big", full=True)
    _count(kc, comm_id, 1.5, sizes=full)
    _request(kc, subshell, comm_id, action="table", id=3, mesh="big", full=False)
    _count(kc, comm_id, 1.5)
    costs = json.loads(_run(kc, STATE_COST).strip().splitlines()[-1])
    _run(kc, "%mesh stop big")
    return {"ranks": n, "spawn_s": round(spawn_s, 1),
            "idle_msgs_per_s": round(idle / idle_s, 2),
            "summary_state_bytes": _mean(summary),
            "three_busy_msgs_per_s": round(few_n / few_s, 2), "three_busy_bytes_per_update": _mean(few),
            "all_busy_msgs_per_s": round(all_n / all_s, 2), "all_busy_bytes_per_update": _mean(every),
            "full_table_bytes": max(full) if full else None,
            "state_build": costs}


def w12() -> dict:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import start_new_kernel

    from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    started = time.monotonic()
    km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=60)
    scale: dict | None = None
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
        if SCALE_RANKS and time.monotonic() - started < SCALE_START_BY_S:
            scale = _scale(kc, subshell, comm_id, SCALE_RANKS)
        elif SCALE_RANKS:
            scale = {"skipped": f"the 4-rank part took {time.monotonic() - started:.0f} s: no time left in the job"}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    out = {"W12_panel_msgs_per_s": {"idle": round(idle / idle_s, 2), "busy_4_ranks": round(busy / busy_s, 2),
                                    "idle_window_s": round(idle_s, 1), "busy_window_s": round(busy_s, 1)}}
    if scale is not None:
        out["W12_panel_scale"] = scale
    log(f"W12: {out}")
    return out
