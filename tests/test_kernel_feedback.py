"""What the kernel says about what it did, through a real kernel: every ``%mesh`` action in
one line, the status widget's last word when its mesh stops, a restarted kernel attaching its
notebook's own detached mesh, a shutdown that leaves nothing on stderr, and ``%mesh tensors``
naming each tensor by the notebook variable that holds it."""

from __future__ import annotations

import pytest
from _kernels import run, text

pytestmark = pytest.mark.timeout(180)


def test_tensors_are_named_by_the_variables_that_hold_them_and_the_rest_counted(kc):
    out, reply = run(kc, "import torch\nprocs = %mesh spawn -n 2\nwith procs.activate():\n"
                         "    w = torch.ones(4, 4)\n    losses = [torch.ones(()) * i for i in range(3)]\n"
                         "    model = torch.nn.Linear(4, 2)\n"
                         "    held = (lambda ts: lambda: ts)([torch.zeros(()) + i for i in range(22)])\n"
                         "    odd = (lambda t: lambda: t)(torch.zeros(2, 3))", timeout=120)
    assert reply["status"] == "ok", text(out)
    out, reply = run(kc, "%mesh tensors")
    assert reply["status"] == "ok", text(out)
    lines = text(out).splitlines()
    assert lines[0] == "procs: 29 tensors, 228 bytes per rank", lines
    rows = [" ".join(line.split()) for line in lines[1:]]
    assert rows == [
        "w [4, 4] float32 on cpu: 64 bytes per rank",
        "losses[0-2] 3 × [] float32 on cpu: 12 bytes per rank",
        "model.weight [2, 4] float32 on cpu: 32 bytes per rank",
        "model.bias [2] float32 on cpu: 8 bytes per rank",
        "1 temporary [2, 3] float32 on cpu: 24 bytes per rank",
        "22 scalar temporaries, 88 bytes per rank",
    ], lines
