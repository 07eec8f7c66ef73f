"""``%mesh run`` and torch.compile through a real monarch kernel: an unmodified torchrun
script on the warm ranks of the current mesh (output streams while it runs, each rank's
exception is shown, the stop button ends it and the ranks stay warm, a second run starts no
process), with or without a group made by ``setup_torch_distributed(procs)``; torch.compile
(inductor) in a ``%%mesh`` cell and in an actor's endpoint.  One kernel and one 2-rank mesh
for the module."""

from __future__ import annotations

import re
import textwrap
import time

import pytest
from support.kernels import iopub, run, text

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent("""
    import argparse, os, time
    import torch, torch.distributed as dist
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(a.steps):
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        if step == 1 and rank == a.fail_rank:
            raise ValueError(f"bad batch on rank {rank}")
        print(f"step {step} sum {t[0].item():.0f}", flush=True)
        time.sleep(a.sleep)
    print(f"rank {rank} of {dist.get_world_size()} done", flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def mkc(module_kc, tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "train.py"
    path.write_text(SCRIPT)
    out, reply = run(module_kc, "procs = %mesh spawn -n 2", timeout=120)
    assert reply["status"] == "ok", text(out)
    module_kc.script = str(path)
    yield module_kc
    run(module_kc, "%mesh stop", timeout=60)


def pids(kc) -> str:
    out, _ = run(kc, "%%mesh\nimport os, sys\n(os.getpid(), 'torch' in sys.modules)", timeout=60)
    return text(out)


def test_a_script_streams_its_output_and_runs_again_warm(mkc):
    msg_id = mkc.execute(f"%mesh run {mkc.script} --steps 4 --sleep 0.5")
    io = iopub(mkc)
    first = io.wait_output(msg_id, "step 0 sum 1", timeout=180)
    outputs = io.wait_idle(msg_id, timeout=180)
    done = outputs[-1].at
    assert done - first.at > 1.0, "the script's output arrived only at the end"
    got = text(outputs)
    assert "[rank 1] rank 1 of 2 done" in got
    assert re.search(r"train\.py finished on \[ranks 0-1\] in [0-9.]+ s", got), got
    before = pids(mkc)
    assert "True)" in before  # torch stays imported on the warm ranks
    started = time.monotonic()
    out, reply = run(mkc, f"%mesh run {mkc.script} --steps 1", timeout=120)
    assert reply["status"] == "ok", text(out)
    assert time.monotonic() - started < 10  # no process start, no import torch
    assert pids(mkc) == before


def test_each_ranks_exception_is_shown(mkc):
    out, reply = run(mkc, f"%mesh run {mkc.script} --steps 4 --fail-rank 1", timeout=120)
    assert reply["status"] == "error"
    got = text(out)
    assert "[rank 1] ValueError: bad batch on rank 1\nTraceback" in got
    assert f'File "{mkc.script}", line 15, in <module>' in got
    assert "[rank 0] RuntimeError" in got  # its peer, cut short at once
    assert "runpy" not in got and "spmd/rank/script.py" not in got  # only the script's own frames
    out, reply = run(mkc, f"%mesh run {mkc.script} --steps 1", timeout=120)  # the next run makes a new group
    assert reply["status"] == "ok", text(out)


def test_the_stop_button_ends_the_script_and_the_ranks_stay_warm(mkc):
    before = pids(mkc)
    msg_id = mkc.execute(f"%mesh run {mkc.script} --steps 100000 --sleep 0.01")
    io = iopub(mkc)
    io.wait_output(msg_id, "step 5 sum 1", timeout=120)
    stopped = time.monotonic()
    mkc.parent.interrupt_kernel()
    outputs = io.wait_idle(msg_id, timeout=60)
    assert time.monotonic() - stopped < 10
    assert "KeyboardInterrupt" in text(outputs)
    assert pids(mkc) == before
    out, reply = run(mkc, f"%mesh run {mkc.script} --steps 1", timeout=120)
    assert reply["status"] == "ok", text(out)


def test_a_script_that_calls_init_process_group_itself_fits_an_existing_group(mkc):
    cell = "from monarch_kernel.spmd import setup_torch_distributed\nsetup_torch_distributed(procs)"
    out, reply = run(mkc, cell, timeout=120)
    assert "'gloo'" in text(out), text(out)
    out, reply = run(mkc, f"%mesh run {mkc.script} --steps 2", timeout=120)
    assert reply["status"] == "ok" and "step 1 sum 1" in text(out), text(out)
    out, _ = run(mkc, "%%mesh\nimport torch.distributed as dist\ndist.is_initialized()", timeout=60)
    assert "[ranks 0-1] True" in text(out)  # the script's destroy_process_group kept the notebook's group


def test_usage_mistakes_say_what_to_type(mkc):
    out, reply = run(mkc, "%mesh run", timeout=30)
    assert "type  %mesh run train.py --lr 0.1" in text(out)
    out, reply = run(mkc, "%mesh run no_such_script.py", timeout=30)
    assert "no_such_script.py: no such file here" in text(out)


def test_torch_compile_in_rank_code_and_in_an_actor(mkc):
    cell = """%%mesh --ranks 0
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
compiled = torch.compile(model)  # inductor: C++ for the CPU, built here
x = torch.randn(4, 8)
bool(torch.allclose(compiled(x), model(x), atol=1e-5)), type(compiled).__name__
"""
    out, reply = run(mkc, cell, timeout=220)
    assert "[rank 0] (True, 'OptimizedModule')" in text(out), text(out)
    actor = """
from monarch_kernel import Actor, endpoint

class Compiled(Actor):
    @endpoint
    def check(self) -> bool:
        import torch
        f = torch.compile(lambda a, b: torch.sin(a) * b + 1)
        a, b = torch.randn(16), torch.randn(16)
        return bool(torch.allclose(f(a, b), torch.sin(a) * b + 1, atol=1e-5))

procs.slice(ranks=0).spawn("compiled", Compiled).check.call_one().get(timeout=200)
"""
    out, reply = run(mkc, actor, timeout=220)
    assert reply["status"] == "ok" and "True" in text(out), text(out)
