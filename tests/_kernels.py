"""Helpers for tests that drive real kernels with jupyter_client."""

from __future__ import annotations

import contextlib
import sys
import time

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import start_new_kernel

from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install


def run(kc, code: str, timeout: float = 60):
    """Execute ``code``; return [(arrival time, text)] of its outputs and the reply content."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append((time.monotonic(), content["text"]))
        elif kind in ("execute_result", "display_data"):
            out.append((time.monotonic(), content["data"].get("text/plain", "")))
        elif kind == "error":
            out.append((time.monotonic(), "\n".join(content["traceback"])))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:  # a late reply to an earlier request
        reply = kc.get_shell_msg(timeout=timeout)
    return out, reply["content"]


def text(out) -> str:
    return "".join(t for _, t in out)


def ensure_kernelspec() -> str:
    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    return KERNEL_NAME


@contextlib.contextmanager
def kernel(name: str):
    """A started kernel's client; the kernel is shut down (and waited for) on exit."""
    km, client = start_new_kernel(kernel_name=name, startup_timeout=60)
    try:
        yield client
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)


def assert_gone(pids, timeout: float, message: str) -> None:
    """Wait up to ``timeout`` s for every pid to exit (zombies count as gone)."""
    import psutil

    def running(p):
        try:
            return psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
