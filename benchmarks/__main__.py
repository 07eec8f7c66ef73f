"""``python -m benchmarks [IDS...]``: run the selected workloads (all by default), each job
in a fresh controller process, and print one JSON object (indent=1) on stdout.
IDs: floors W1 W2 W3 W4 (W4a, W4b) W5 W6 W7 W8 W9 (across hosts, directly and through a login host with
out_of_cluster=True: needs root; W9jump the latter alone) panel (W12: the Mesh panel)
W1slurm (W1 over Slurm: needs root and Slurm's daemons) W10 (distributed training, torchrun beside
the mesh; W10hang alone: a rank stopped in a collective to HangError in the cell; W10restart alone: a
rank SIGKILLed to its replacement answering, under the restart policy, here and on another host (root);
W10elastic alone: a rank SIGKILLed under elastic_run to the next step, replaced, then shrink and grow)
W13 (distributed tensors: chained ops, an op plus inspect, rank memory over temporaries)
W13c (their reductions and to_mesh, at 4 and 16 ranks) W14 (observability: stacks of 8, 64 and 256
ranks; the collectives recorder's and the profiler's cost on W10's step) history (the run's history:
its cost on W7's cell and on ranks printing flat out, and a grouped query over 4M lines,
``HISTORY_BENCH_SCALE=0.1`` for a tenth) chaos (faults at random across hosts during a mixed
workload: ``chaos --seed N --minutes M [--restart-policy] [--watchdog T]``; needs root; not in
the default run) gpu (the CUDA tests and GPU benchmarks, ``make gpu-check``: under 5 minutes; without
a GPU it says so, runs its shm part and exits 0; exit 1 when a CUDA test failed; not in the
default run).  Progress and ranks' output go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from ._util import ROOT, kill_group, log

# id -> [(job, extra env, timeout s)]; a job runs as ``python -m benchmarks._run JOB``.
WORKLOADS = {
    "floors": [("floors", {}, 60)],
    "W1": [("W1", {}, 150)],
    "W2": [("W2", {}, 120)],
    "W3": [("W3", {}, 120)],
    "W4": [("W4", {}, 240)],
    "W5": [("W5", {}, 150)],
    "W6": [("W6", {}, 60)],
    "W7": [("W7", {}, 180)],
    "W8": [("W8", {"MONARCH_KERNEL_FANOUT": "8"}, 180), ("W8flat", {"MONARCH_KERNEL_FANOUT": "64"}, 180)],
    "W9": [("W9", {}, 400), ("W9jump", {}, 240)],
    "W9jump": [("W9jump", {}, 240)],
    "W1slurm": [("W1slurm", {}, 180)],
    "panel": [("panel", {}, 120)],
    "W10": [("W10", {}, 900), ("W10hang", {}, 240), ("W10restart", {}, 240), ("W10restart_hosts", {}, 300),
            ("W10elastic", {}, 300)],
    "W10hang": [("W10hang", {}, 240)],
    "W10restart": [("W10restart", {}, 240), ("W10restart_hosts", {}, 300)],
    "W10elastic": [("W10elastic", {}, 300)],
    "W13": [("W13", {}, 900)],
    "W14": [("W14stacks", {}, 600), ("W14recorder", {}, 600)],
    "W13c": [("W13c", {}, 900), ("W13c16", {}, 1500)],
    # the history's cost beside W7, and its query figure (HISTORY_BENCH_SCALE=0.1 for a quick run)
    "history": [("history_cell", {}, 600), ("history_lines", {}, 600), ("history_paced", {}, 600),
                ("history_query", {}, 1800)],
    # Not in the default run (make bench-scale): minutes, and about 6 GiB at 1,024 ranks.
    "W11": [("W11", {"MONARCH_KERNEL_FANOUT": "8"}, 1500), ("W11flat", {"MONARCH_KERNEL_FANOUT": "1024"}, 1500)],
    # Not in the default run either: --minutes (10 by default) of faults; its env and timeout
    # are filled in from --seed and --minutes.
    "chaos": [("chaos", {}, 0)],
    # Not in the default run (make gpu-check): the CUDA tests and GPU benchmarks, under 5 minutes;
    # without a GPU it says so and runs its shm part alone.
    "gpu": [("gpu", {}, 290)],
}
# W9 and W10 run the ones they name
DEFAULT = [w for w in WORKLOADS if w not in ("W11", "chaos", "W9jump", "W10hang", "W10restart", "W10elastic",
                                         "gpu")]
ALIASES = {"W4A": "W4", "W4B": "W4", "FLOOR": "floors", "FLOORS": "floors", "W1SLURM": "W1slurm", "W9JUMP": "W9jump",
           "W10HANG": "W10hang", "W10RESTART": "W10restart", "W10ELASTIC": "W10elastic", "CHAOS": "chaos",
           "GPU": "gpu", "HISTORY": "history"}


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _run_job(job: str, env: dict, timeout: float) -> dict:
    fd, out = tempfile.mkstemp(prefix=f"mkbench-{job}-", suffix=".json")
    os.close(fd)
    t = time.perf_counter()
    log(f"--- {job} ---")
    try:
        p = subprocess.Popen([sys.executable, "-m", "benchmarks._run", job, out], cwd=ROOT,
                             env={**os.environ, **env}, stdout=sys.stderr, stderr=sys.stderr,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except BaseException:
            kill_group(p)
            raise
        if rc != 0:
            return {f"{job}_error": f"exited with code {rc} (see stderr)"}
        with open(out) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {f"{job}_error": f"timed out after {timeout} s"}
    finally:
        os.unlink(out)
        log(f"--- {job}: {time.perf_counter() - t:.1f} s ---")


def _ratios(results: dict) -> None:
    """W2 and W3 (4 ranks) against their floors measured in the same run (issue 19's targets:
    W2 <= 1.5x the ipc round trip, W3 on 4 ranks <= 2x the round trip to 4 peers)."""
    def median(*path):
        v = results
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    pairs = {"W2_over_floor": (("W2_call_one_us", "median"), ("floor_pyzmq_rtt_us", "median")),
             "W3_n4_over_floor": (("W3_call_all_us", "n4", "median"), ("floor_pyzmq_rtt_4_peers_us", "median")),
             # issue 35: through one login host against the same calls to a host reached directly
             "W9jump_call_one_over_direct": (("W9jump_call_one_us", "median"), ("W9_W2_remote_call_one_us", "median")),
             "W9jump_call_n4_over_direct": (("W9jump_call_n4_us", "median"), ("W9_W3_remote_n4_us", "median"))}
    out = {}
    for name, (num, den) in pairs.items():
        a, b = median(*num), median(*den)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
            out[name] = round(a / b, 2)
    if out:
        results["ratios"] = out


def _version(dist: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks",
                                 description="Run monarch_kernel benchmarks; print one JSON object on stdout.")
    ap.add_argument("ids", nargs="*", help="workloads to run (default: all but W11): " + " ".join(WORKLOADS))
    ap.add_argument("--seed", type=int, default=1, help="chaos: the seed of its schedule (default 1)")
    ap.add_argument("--minutes", type=float, default=10.0, help="chaos: how long faults are injected (default 10)")
    ap.add_argument("--restart-policy", action="store_true",
                    help="chaos: both meshes spawned with restart='on-failure': the runtime replaces dead ranks, "
                         "the run never calls restart itself")
    ap.add_argument("--watchdog", type=float, default=0.0, metavar="T",
                    help="chaos: a hang watchdog (T s, then dump) on both meshes; a report with no hang is a "
                         "false alarm (default: off)")
    args = ap.parse_args(argv)
    ids = []
    for raw in args.ids or DEFAULT:
        key = ALIASES.get(raw.upper(), raw.upper() if raw.upper() in WORKLOADS else raw)
        if key not in WORKLOADS:
            ap.error(f"unknown workload {raw!r}; choose from {', '.join(WORKLOADS)}")
        if key not in ids:
            ids.append(key)
    t0 = time.perf_counter()
    results: dict = {}
    for wid in ids:
        for job, env, timeout in WORKLOADS[wid]:
            if job == "chaos":
                env = {"MK_CHAOS_SEED": str(args.seed), "MK_CHAOS_SECONDS": str(args.minutes * 60),
                       "MK_CHAOS_POLICY": "1" if args.restart_policy else "",
                       "MK_CHAOS_WATCHDOG": str(args.watchdog or "")}
                timeout = int(args.minutes * 60) + 900  # setup, the last recovery, the checks at the end
            _merge(results, _run_job(job, env, timeout))
    _ratios(results)
    import zmq

    from monarch_kernel.runtime.wire import native

    built, why = native.is_available()  # a tree without the built C wire measures the pure-Python one
    results["meta"] = {"workloads": ids, "elapsed_s": round(time.perf_counter() - t0, 1),
                       "cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": _version("torch"), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                       "wire": "C" if built else f"pure Python: {why}", "platform": platform.platform()}
    print(json.dumps(results, indent=1))
    failed = results.get("cuda_tests", {})
    return 1 if "gpu" in ids and (failed.get("failed") or failed.get("error") or "gpu_error" in results) else 0


if __name__ == "__main__":
    sys.exit(main())
