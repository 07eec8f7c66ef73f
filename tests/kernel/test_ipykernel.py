"""Futures in a real ipykernel: blocking ``.get()`` and top-level ``await`` in cells, with
rank output reaching the cell and a rank's failure leaving the kernel alive."""

from __future__ import annotations

import pytest
from support.kernels import run, text

pytestmark = pytest.mark.timeout(120)


def test_get_and_await_in_cells(ipython_kc):
    out, reply = run(ipython_kc, """
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
    t = text(out)
    assert "get [5, 5]" in t

    out, reply = run(ipython_kc, "vm = await m.aecho.call(6)\nprint(f'await {list(vm.values())}')")
    assert reply["status"] == "ok", out
    assert "await [6, 6]" in text(out)

    out, reply = run(ipython_kc, """
try:
    m.slice(gpus=1).die.call_one().get(timeout=30)
except ProcessDied as e:
    print(f"died {e.exitcode}")
print(f"still {await m.slice(gpus=0).aecho.call_one(7)}")
""")
    assert reply["status"] == "ok", out
    t = text(out)
    assert "died 7" in t and "still 7" in t

    out, reply = run(ipython_kc, "procs.stop().get(timeout=30); print('stopped')")
    assert reply["status"] == "ok" and "stopped" in text(out)
