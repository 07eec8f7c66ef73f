"""``spmd.profile(procs)``: torch.profiler on every rank for a block, the traces merged into one
Chrome-trace file with a process row per rank, and a report that names the slow rank."""

from __future__ import annotations

import json
import time

import pytest

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.spmd import profile

pytestmark = pytest.mark.timeout(180)


class Worker(Actor):
    @endpoint
    def work(self, n: int) -> None:
        import torch
        from torch.profiler import record_function

        from monarch_kernel import current_rank

        slow = current_rank().rank == 1
        for _ in range(3):
            with record_function("step"):
                for _ in range(n * (8 if slow else 1)):  # rank 1: eight times the ops
                    torch.mm(torch.randn(96, 96), torch.randn(96, 96))
                if slow:
                    time.sleep(0.3)  # and waits in each step: a straggler on any machine


def test_a_profiled_block_merges_every_ranks_trace_and_names_the_straggler(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        w = procs.spawn("w", Worker)
        w.work.call(1).get(timeout=60)  # torch imported and warm
        path = tmp_path / "trace.json"
        with profile(procs, str(path)) as prof:
            w.work.call(5).get(timeout=120)
        report = prof.report
        assert report is not None and report.path == str(path)
        assert [r.rank for r in report.ranks] == [0, 1]
        assert all(len(r.steps) == 3 for r in report.ranks), [r.steps for r in report.ranks]
        assert report.stragglers() == [1], repr(report)
        assert report.straggler_line().startswith("straggler: rank 1 over 20% above the median")
        mm = next(row for row in report.top_ops() if row["op"] == "aten::mm")
        assert mm["calls"] == 3 * 5 * 9, mm
        step = next(row for row in report.top_ops() if row["op"] == "step")
        assert step["slowest_rank"] == 1 and step["spread_pct"] > 50, step
        assert all(abs(r.offset_us) < 1e6 for r in report.ranks)  # one host: the same clock, nearly
        trace = json.loads(path.read_text())
        rows = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
        assert sorted(rows) == [0, 1] and rows[1].startswith("rank 1 (")
        names = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert {(0, "aten::mm"), (1, "aten::mm"), (0, "step"), (1, "step")} <= names
        text = repr(prof)
        assert text.startswith(f"Profile of mesh '{procs.name}': 2 ranks; trace: {path}") and "aten::mm" in text
        assert "<img src='data:image/png;base64," in prof._repr_html_()
        with pytest.raises(AttributeError, match="from monarch_kernel.spmd import profile"):
            procs.profile()
    finally:
        procs.stop().get(timeout=30)
