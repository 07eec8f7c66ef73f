"""torch.profiler on a rank, for ``%%mesh --profile`` and ``spmd.profile(procs)``: started and
stopped from the rank's ``ElasticEnvActor`` (a thread of its own), it records every thread
of the rank (``profile_all_threads``), so the cell or the endpoints the block calls are in
it wherever they run.  ``stop`` hands back the rank's Chrome trace, its ops' totals and its
steps; the controller merges the ranks.  torch's profiler (kineto) prints from C++ as it
starts and stops (``USDT: ... profiler_start``); those lines are kept out of the rank's output.
Runs on ranks; imports torch when started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time

STEP = re.compile(r"^(ProfilerStep#\d+|step.*)$", re.IGNORECASE)
# What kineto prints from C++: "USDT:2026-12-04 19:19:43 10305:10305 SyncActivityProfilerHandler.cpp:52] ...".
CHATTER = re.compile(r"^(USDT|STAGE|INFO|WARNING|ERROR|LOG):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\] ")

_lock = threading.Lock()
_running: list = []  # [profile, started (monotonic)] while one runs


def start(cuda: bool | None = None) -> bool:
    """Start profiling this rank (CPU, and CUDA where present unless ``cuda`` is False)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if (cuda is None and torch.cuda.is_available()) or cuda:
        activities.append(ProfilerActivity.CUDA)
    kwargs: dict = {"activities": activities}
    try:
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        pass  # an older torch: the actor's own thread only
    with _lock:
        if _running:
            raise RuntimeError("this rank is already being profiled: leave the other profile() block first")
        prof = profile(**kwargs)
        with _without_chatter():
            prof.__enter__()
        _running[:] = [prof, time.monotonic()]
    return True


def stop(top: int = 200) -> dict:
    """Stop, and return ``{"trace": Chrome-trace JSON bytes, "ops": [[name, calls, total µs,
    self µs], ...], "steps": [µs, ...], "block_s", "pid", "host"}``."""
    with _lock:
        if not _running:
            raise RuntimeError("this rank is not being profiled")
        prof, started = _running
        _running.clear()
    with _without_chatter():
        prof.__exit__(None, None, None)
    block_s = time.monotonic() - started
    fd, path = tempfile.mkstemp(prefix="mk-profile-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            trace = f.read()
    finally:
        os.unlink(path)
    ops = sorted(([e.key, e.count, float(e.cpu_time_total), float(e.self_cpu_time_total)]
                  for e in prof.key_averages()), key=lambda o: -o[2])[:top]
    steps = []
    for e in json.loads(trace).get("traceEvents", []):
        if e.get("ph") == "X" and STEP.match(str(e.get("name", ""))) and e.get("cat") in ("user_annotation", None):
            steps.append(float(e.get("dur", 0.0)))
    return {"trace": trace, "ops": ops, "steps": steps, "block_s": block_s, "pid": os.getpid(),
            "host": socket.gethostname()}


def clock() -> int:
    """This rank's wall clock, ns (the controller estimates each rank's offset from it)."""
    return time.time_ns()


@contextlib.contextmanager
def _without_chatter():
    """Run the block with this process's fd 2 in a temporary file, then write back what it
    got there but kineto's chatter (``CHATTER``): what other threads wrote meanwhile is late,
    never lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as got:
        os.dup2(got.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            got.seek(0)
            kept = [line for line in got.read().splitlines(keepends=True)
                    if not CHATTER.match(line.decode(errors="replace"))]
            if kept:
                os.write(2, b"".join(kept))
