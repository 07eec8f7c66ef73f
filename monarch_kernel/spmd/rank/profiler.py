"""torch.profiler on a rank, for ``%%mesh --profile`` and ``spmd.profile(procs)``: started and
stopped from the rank's ``ElasticEnvActor`` (a thread of its own), it records every thread
of the rank (``profile_all_threads``), so the cell or the endpoints the block calls are in
it wherever they run.  ``stop`` hands back the rank's Chrome trace, its ops' totals and its
steps; the controller merges the ranks.  Runs on ranks; imports torch when started.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import time

STEP = re.compile(r"^(ProfilerStep#\d+|step.*)$", re.IGNORECASE)

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
