"""``spmd.profile(procs)``: torch.profiler on every rank for a block, the traces merged into one
Chrome-trace file with a process row per rank, and a report that names the slow rank."""

from __future__ import annotations

import json

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

        for _ in range(3):
            with record_function("step"):
                for _ in range(n * (8 if current_rank().rank == 1 else 1)):  # rank 1: eight times the work
                    torch.mm(torch.randn(96, 96), torch.randn(96, 96))


def test_a_profiled_block_merges_every_ranks_trace_and_names_the_straggler(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        w = procs.spawn("w", Worker)
        w.work.call(1).get(timeout=60)  # torch imported and warm
        path = tmp_path / "trace.json"
        with profile(procs, str(path)) as prof:
            w.work.call(20).get(timeout=120)
        report = prof.report
        assert report is not None and report.path == str(path)
        assert [r.rank for r in report.ranks] == [0, 1]
        assert all(len(r.steps) == 3 for r in report.ranks), [r.steps for r in report.ranks]
        assert report.stragglers() == [1], repr(report)
        assert report.straggler_line().startswith("straggler: rank 1 over 20% above the median")
        mm = next(row for row in report.top_ops() if row["op"] == "aten::mm")
        assert mm["slowest_rank"] == 1 and mm["calls"] == 3 * 20 * 9 and mm["spread_pct"] > 50, mm
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
