"""``spmd.profile(procs)``: torch.profiler on every rank of a mesh for a block of controller
code (``%%mesh --profile``: for one cell), the ranks' traces merged into one Chrome-trace /
Perfetto file with one process row per rank, clocks aligned by the controller's estimate of
each rank's offset.  Runs in the controller; ``rank/profiler.py`` is the ranks' half.

    with profile(procs) as prof:
        trainer.step.call().get()
    prof.report        # top ops, slowest rank and spread, steps per rank, the file's path
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .env import SETUP_TIMEOUT_S, record
from .profile_report import ProfileReport, RankProfile

CLOCK_SAMPLES = 5


class profile:  # noqa: N801 - a context manager named as torch.profiler.profile is
    """torch.profiler on every rank of ``procs`` for the block: the ranks' traces merged into one
    Chrome-trace file (``path``), and a ``ProfileReport``.

    Example::

        with profile(procs) as prof:
            trainers.step.call(8).get()
        print(prof)
    """

    def __init__(self, procs, path: str | None = None, *, cuda: bool | None = None):
        self.procs = procs
        self.path = path
        self.cuda = cuda
        self.report: ProfileReport | None = None
        self._env: Any = None

    def __enter__(self) -> profile:
        self._env = record(self.procs).env.flatten("rank")
        self._env.profile_start.call(self.cuda).get(timeout=SETUP_TIMEOUT_S)
        return self

    def __exit__(self, *exc) -> None:
        env = self._env
        assert env is not None
        got = env.profile_stop.call().get(timeout=SETUP_TIMEOUT_S)
        n = len(got)
        offsets = [_offset_us(env.slice(rank=i)) for i in range(n)]
        path = self.path or os.path.abspath(f"monarch-profile-{self.procs.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        ranks = []
        events: list = []
        base_us = float(int(time.time() - 3600) * 1_000_000)  # the merged file's zero, on our clock
        for i in range(n):
            got_i = got[{"rank": i}]
            trace = json.loads(got_i["trace"])
            # torch writes times in µs after its own base: on our clock, after ours
            shift = trace.get("baseTimeNanoseconds", 0) / 1e3 - offsets[i] - base_us
            events.extend(_rank_events(trace, i, got_i["host"], got_i["pid"], shift))
            ranks.append(RankProfile(i, got_i["host"], got_i["pid"], got_i["block_s"], offsets[i],
                                     {name: (calls, total) for name, calls, total, _self in got_i["ops"]},
                                     got_i["steps"]))
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": int(base_us * 1e3),
                       "otherData": {"mesh": self.procs.name, "offsets_us": offsets}}, f)
        self.report = ProfileReport(self.procs.name, path, ranks)

    def _repr_html_(self) -> str:
        return self.report._repr_html_() if self.report is not None else "<i>profiling…</i>"

    def __repr__(self) -> str:
        return repr(self.report) if self.report is not None else f"profile of mesh '{self.procs.name}' (running)"


def _offset_us(one) -> float:
    """The rank's clock minus ours, from the round trip with the least time (NTP's estimate)."""
    best = None
    for _ in range(CLOCK_SAMPLES):
        t0 = time.time_ns()
        theirs = one.clock.call_one().get(timeout=SETUP_TIMEOUT_S)
        t1 = time.time_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, theirs - (t0 + t1) / 2)
    assert best is not None
    return best[1] / 1e3


def _rank_events(trace: dict, rank: int, host: str, pid: int, shift_us: float) -> list:
    """The rank's events as one process row (``pid`` = the rank), ``shift_us`` later (its
    times on the controller's clock, from the merged file's zero)."""
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({host}, pid {pid})"}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
            continue
        e = dict(e)
        e["pid"] = rank
        if isinstance(e.get("ts"), int | float):
            e["ts"] = e["ts"] + shift_us
        out.append(e)
    return out
