"""``procs.stacks()``: every rank's threads, grouped; each rank's own dump where it can
answer, py-spy (run by the rank's template) from outside where it cannot.  The situations
are real: ranks blocked in a gloo all_reduce that one rank, stuck loading data, never
joins; a SIGSTOPped rank; a rank holding the GIL in C code."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.config import configured
from support.freeze import freeze

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.observe.stack_report import StackReport
from monarch_kernel.spmd import collectives, setup_torch_distributed

pytestmark = pytest.mark.timeout(180)


def load_batch(seconds: float) -> None:
    """The data loader of the test: rank 3 is stuck in it."""
    time.sleep(seconds)


class Trainer(Actor):
    @endpoint
    def step(self, slow_rank: int) -> int:
        import torch
        import torch.distributed as dist

        from monarch_kernel import current_rank

        if current_rank().rank == slow_rank:
            load_batch(600)
        t = torch.ones(4)
        dist.all_reduce(t)
        return int(t[0])


class Poke(Actor):
    """A second actor on the same ranks: its own worker, free while the trainer's is stuck."""

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def spin(self) -> int:
        return sum(range(10**12))  # C code holding the GIL, for minutes


def _until(what, cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:g} s; last: {last!r}")


@pytest.fixture(scope="module")
def eight():
    procs = this_host().spawn_procs(per_host={"gpus": 8})
    setup_torch_distributed(procs, "gloo")
    yield procs, procs.spawn("trainer", Trainer), procs.spawn("poke", Poke)
    procs.stop().get(timeout=30)


def _frames(report: StackReport, rank: int) -> list[str]:
    stack = next(s for s in report.stacks if s.rank == rank)
    return [f.name for t in stack.threads for f in t.frames]


def test_seven_ranks_in_all_reduce_and_the_one_loading_data_stand_apart(eight):
    procs, trainer, _ = eight
    trainer.step.call(3)  # never returns: the mesh is stopped at the end

    def grouped():
        r = procs.stacks()
        ok = [len(g.ranks) for g in r.groups] == [1, 7] and r.odd_ranks() == [3]
        return r if ok and "load_batch" in _frames(r, 3) else None

    report = _until("rank 3 alone in its group, in load_batch", grouped)
    assert list(report.methods()) == ["in-process"], report.methods()  # every rank answered itself
    outside = procs.stacks(method="py-spy")
    assert list(outside.methods()) == ["py-spy"] and outside.odd_ranks() == [3], outside
    assert outside.summary() == report.summary()  # the same frames, read both ways
    majority = report.groups[-1]
    assert majority.ranks == [0, 1, 2, 4, 5, 6, 7]
    text = repr(report)
    assert text.splitlines()[0] == f"Stacks of mesh '{procs.name}': 8 ranks in 2 groups"
    summary = report.summary()
    assert summary[0].startswith("[rank 3] ") and "load_batch" in summary[0]
    assert summary[1].startswith("[ranks 0-2,4-7] ") and "step" in summary[1]
    assert "monarch_kernel" not in text  # the runtime's own frames are folded away
    full = procs.stacks([3], runtime_frames=True)
    assert any("monarch_kernel" in f.filename for t in full.stacks[0].threads for f in t.frames)
    assert "<table>" in report._repr_html_()
    with pytest.raises(IndexError, match="not in this mesh of 8 ranks"):
        procs.stacks([8])
    # The flight recorder: seven ranks inside all_reduce #1, rank 3 never entered it.
    fr = collectives(procs)
    assert fr.holding_up() == [3], fr
    assert fr.lines()[0].startswith("default_pg: ranks 0-2,4-7 in all_reduce #1 (started "), fr.lines()
    assert "; rank 3 last finished #0 and is at test_stacks.py:" in fr.lines()[0] and "(load_batch)" in fr.lines()[0]
    assert "[rank 3] load_batch (" in repr(fr)  # with its stack


def test_a_stopped_rank_and_one_holding_the_gil_in_c_code_still_show(eight):
    procs, _, poke = eight
    pid = poke.slice(gpus=5).pid.call_one().get(timeout=30)
    freeze(pid)
    try:
        r = procs.stacks([5], all_threads=True)
        assert r.stacks[0].method == "py-spy" and r.stacks[0].threads, r
    finally:
        os.kill(pid, signal.SIGCONT)
    spinner = poke.slice(gpus=6)
    spinner.spin.call_one()
    r = _until("rank 6 seen in Poke.spin", lambda: (lambda x: x if "Poke.spin" in _frames(x, 6) else None)(
        procs.stacks([6])))
    assert r.stacks[0].method == "py-spy"
    native = procs.stacks([6], native=True)  # C frames too: where the spinning rank is in the interpreter
    assert native.stacks[0].method == "py-spy --native", native
    names = [f.name for t in native.stacks[0].threads for f in t.frames]
    assert "Poke.spin" in names and any(n.startswith(("builtin_sum", "_Py", "Py")) for n in names), names


def test_a_rank_that_cannot_answer_and_may_not_be_read_says_why(eight):
    procs, _, poke = eight
    pid = poke.slice(gpus=4).pid.call_one().get(timeout=30)
    freeze(pid)
    try:
        with configured(stacks_py_spy=False):
            r = procs.stacks([0, 4], all_threads=True, runtime_frames=True, timeout=3)
    finally:
        os.kill(pid, signal.SIGCONT)
    ok, stopped = r.stacks
    assert ok.method == "in-process" and any(t.name == "MainThread" for t in ok.threads), ok
    assert stopped.method == "none" and "py-spy: off (MONARCH_KERNEL_STACKS_PY_SPY=0)" in stopped.error, stopped
    assert "did not dump its own stacks within 3 s" in stopped.error
    assert f"[rank 4] no stack: {stopped.error}" in r.summary()
    with pytest.raises(ValueError, match="choose one of auto, py-spy, in-process"):
        procs.stacks(method="gdb")


class Recorded(Actor):
    @endpoint
    def collectives_recorded_in_python(self) -> dict:
        import socket

        import torch
        import torch.distributed as dist

        from monarch_kernel.spmd.rank import flight

        flight.python_recorder()  # as on a torch without its own recorder
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            dist.all_reduce(torch.ones(3))
            dist.broadcast(torch.ones(2, dtype=torch.int64), 0)
            return flight.snapshot()
        finally:
            dist.destroy_process_group()


def test_a_torch_without_its_recorder_is_recorded_in_python():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        snap = procs.spawn("rec", Recorded).collectives_recorded_in_python.call_one().get(timeout=120)
    finally:
        procs.stop().get(timeout=30)
    assert snap["recorder"] == "python"
    g = snap["groups"]["default_pg"]
    assert (g["last_enqueued"], g["last_completed"]) == (2, 2)
    assert [(e["op"], e["sizes"], e["dtype"]) for e in g["entries"]] == [("all_reduce", [[3]], "float32"),
                                                                          ("broadcast", [[2]], "int64")]


def test_stacks_name_a_notebook_cell_as_tracebacks_do(kc):
    """``cell [5], line 4: time.sleep(20)``, IPython's ``Cell In[5], line 4`` with the line
    quoted, where the stacks used to say ``<module> (4060393333.py:4)``: in a function the
    cell defined, and in the cell itself while it runs (the watchdog's stacks)."""
    from support.kernels import run, text

    run(kc, "procs = %mesh spawn -n 2")
    out, reply = run(kc, "%%mesh --ranks 1\nimport threading, time\ndef stuck_in_load():\n    time.sleep(600)\n"
                         "threading.Thread(target=stuck_in_load, name='loader', daemon=True).start()")
    assert reply["status"] == "ok", text(out)
    defined = reply["execution_count"]
    out, reply = run(kc, "%mesh stacks")
    t = text(out)
    assert f"[rank 1] stuck_in_load (cell [{defined}], line 4: time.sleep(600))" in t, t
    assert ".py:4)" not in t, t  # no hashed cell file name
    run(kc, "%mesh watchdog 2")
    out, reply = run(kc, "%%mesh --ranks 0\nimport time\ntime.sleep(8)")
    assert reply["status"] == "ok", text(out)
    t = text(out)
    assert f"[rank 0] cell [{reply['execution_count']}], line 3: time.sleep(8)" in t, t
    # The rank's own `python -c` is no frame of anyone's: the stacks end in the cell.
    # Each watchdog report names the line twice (summary, then stacks); a loaded machine may make
    # it report more than once in the 8 s.
    cited = t.count(f"cell [{reply['execution_count']}], line 3")
    assert "<string>" not in t and cited >= 2 and cited % 2 == 0, t
    out, reply = run(kc, "%mesh stacks 0")
    html = next(o.data["text/html"] for o in out if o.kind == "execute_result")
    assert "1 rank in 1 group <small>" in html, html  # not "1 ranks in 1 groups"


def test_the_entry_frame_of_python_c_is_dropped_from_a_dump():
    """The outermost frame of a rank, ``<module> (<string>:1)`` (its ``python -c``), says nothing."""
    from monarch_kernel.observe.stack_report import from_json

    frames = [{"name": "sleep", "filename": "/x/data.py", "line": 3}, {"name": "<module>", "filename": "<string>",
                                                                       "line": 1}]
    [thread] = from_json(0, "h", "in-process", [{"thread_name": "MainThread", "frames": frames}]).threads
    assert [str(f) for f in thread.frames] == ["sleep (data.py:3)"]
