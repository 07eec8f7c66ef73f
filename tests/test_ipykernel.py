"""Futures in a real ipykernel: blocking ``.get()`` and top-level ``await`` in cells, with
rank output reaching the cell and a rank's failure leaving the kernel alive."""

from __future__ import annotations

import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.timeout(120)


def run(kc, code: str, timeout: float = 60) -> tuple[list[str], dict]:
    """Execute ``code``; return its stream text and the reply content."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] in ("execute_result", "display_data"):
            out.append(msg["content"]["data"].get("text/plain", ""))
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    return out, reply["content"]


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_get_and_await_in_cells(kernel):
    out, reply = run(kernel, """
from monarch_kernel import Actor, endpoint, this_host, ProcessDied
import os

class Echo(Actor):
    @endpoint
    def echo(self, x):
        print("echo", x, flush=True)
        return x
    @endpoint
    async def aecho(self, x):
        return x
    @endpoint
    def die(self):
        os._exit(7)

procs = this_host().spawn_procs(per_host={"gpus": 2})
m = procs.spawn("echo", Echo)
print(f"get {list(m.echo.call(5).get(timeout=30).values())}")
""")
    assert reply["status"] == "ok", out
    text = "".join(out)
    assert "get [5, 5]" in text

    out, reply = run(kernel, "vm = await m.aecho.call(6)\nprint(f'await {list(vm.values())}')")
    assert reply["status"] == "ok", out
    assert "await [6, 6]" in "".join(out)

    out, reply = run(kernel, """
try:
    m.slice(gpus=1).die.call_one().get(timeout=30)
except ProcessDied as e:
    print(f"died {e.exitcode}")
print(f"still {await m.slice(gpus=0).aecho.call_one(7)}")
""")
    assert reply["status"] == "ok", out
    text = "".join(out)
    assert "died 7" in text and "still 7" in text

    out, reply = run(kernel, "procs.stop().get(timeout=30); print('stopped')")
    assert reply["status"] == "ok" and "stopped" in "".join(out)
