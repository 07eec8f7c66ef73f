"""Runs one benchmark job in this (fresh) process and writes its results as JSON to a file:
``python -m benchmarks._run JOB OUTFILE``.  Stdout is left to the ranks' forwarded output.
"""

from __future__ import annotations

import importlib
import json
import sys

JOBS = {
    "floors": ("floors", "floors"),
    "W1": ("spawn", "w1"),
    "W2": ("calls", "w2"),
    "W3": ("calls", "w3"),
    "W4": ("data", "w4"),
    "W5": ("failure", "w5"),
    "W6": ("spawn", "w6"),
    "W7": ("kernel", "w7"),
    "W8": ("calls", "w8"),
    "W8flat": ("calls", "w8_flat"),
    "W9": ("hosts", "w9"),
    "W9jump": ("hosts", "w9_jump"),
    "W11": ("scale", "w11"),
    "W11flat": ("scale", "w11"),
    "W1slurm": ("slurm", "w1_slurm"),
    "panel": ("panel", "w12"),
    "W10": ("training", "w10"),
    "W10hang": ("hang", "w10_hang"),
    "W10restart": ("restart", "w10_restart"),
    "W10restart_hosts": ("restart", "w10_restart_hosts"),
    "W10elastic": ("elastic", "w10_elastic"),
    "W13": ("tensors", "w13"),
    "W14stacks": ("stacks", "w14_stacks"),
    "W14recorder": ("stacks", "w14_recorder"),
    "W13c": ("tensor_collectives", "w13_collectives"),
    "W13c16": ("tensor_collectives", "w13_collectives_16"),
    "chaos": ("chaos", "chaos"),
    "gpu": ("gpu", "gpu"),
    "history_cell": ("history", "cell_cost"),
    "history_lines": ("history", "lines_cost"),
    "history_paced": ("history", "paced_cost"),
    "history_query": ("history", "query"),
}


def main() -> None:
    job, outfile = sys.argv[1], sys.argv[2]
    module, fn = JOBS[job]
    result = getattr(importlib.import_module(f"benchmarks.{module}"), fn)()
    with open(outfile, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
