"""CPU time and resident memory of ranks, for ``%mesh top`` and the panel's sparklines: read
from /proc on the rank's own host, by the controller for local ranks and by the host's agent
for ranks on other hosts (the controller cannot read another host's /proc).  Nothing is
sampled unless asked: an idle kernel sends nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ..completion import Completion
from . import host_messages as hw

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def usage(pid: int | None) -> tuple[int, int] | None:
    """``(CPU ticks used, resident bytes)`` of a process on this host, or None if it is gone."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE
        return int(fields[11]) + int(fields[12]), rss  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def wanted(pid: int | None) -> tuple[int, int]:
    """``(ns, runnable)``: nanoseconds the threads of a process on this host have run or
    waited to run (their ``schedstat``), and how many of them are runnable now (state R);
    ``(-1, -1)`` where the kernel does not keep it.  What it asks of the CPU, so a rank
    computing on a crowded machine is seen computing even when it gets little of a core; the
    kernel adds a wait to ``schedstat`` only once the thread runs, so one starved for a whole
    sample shows only as runnable."""
    if not pid:
        return -1, -1
    total, runnable, seen = 0, 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return -1, -1
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split(None, 1)[0]
            total, seen = total + int(run) + int(wait), True
            runnable += state == b"R"
        except (OSError, ValueError, IndexError):
            continue  # that thread ended
    return (total, runnable) if seen else (-1, -1)


def gpu_usage(pids: list[int]) -> dict[int, tuple[int, int]]:
    """``{pid: (GPU utilisation %, GPU memory MiB)}`` of those of ``pids`` that use an NVIDIA
    GPU of this host (the utilisation is their GPU's); empty without ``nvidia-smi``."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not pids:
        return {}
    try:
        apps = subprocess.run([smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=3).stdout
        gpus = subprocess.run([smi, "--query-gpu=uuid,utilization.gpu", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=3).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_gpu_usage(apps, gpus, set(pids))


def parse_gpu_usage(apps: str, gpus: str, pids: set[int]) -> dict[int, tuple[int, int]]:
    """``nvidia-smi``'s two CSV answers (compute apps; GPUs) -> ``gpu_usage``'s map."""
    util = {}
    for line in gpus.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            util[parts[0]] = int(parts[1])
    out: dict[int, tuple[int, int]] = {}
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids and parts[2].isdigit():
            pid = int(parts[0])
            mem = out.get(pid, (0, 0))[1] + int(parts[2])
            out[pid] = (max(out.get(pid, (0, 0))[0], util.get(parts[1], 0)), mem)
    return out


def measure(pids: list[int], want: bool = True) -> list[tuple[int, int, int, int, int, int, int]]:
    """``[pid, CPU ticks, resident bytes, GPU %, GPU MiB, CPU wanted ns, threads runnable]``
    each (-1: gone, no GPU, no ``schedstat``, or not ``want``: it reads two files per thread)."""
    gpu = gpu_usage(pids)
    return [(p, *(usage(p) or (-1, -1)), *gpu.get(p, (-1, -1)), *(wanted(p) if want else (-1, -1))) for p in pids]


def usages(pids: list[int]) -> hw.Usages:
    return hw.Usages(0, measure(pids))


def sample(rt, om, ranks: list[int], want: bool = False) -> Completion:
    """From any thread: ``{rank: (ticks, rss bytes, GPU %, GPU MiB, CPU wanted ns, threads
    runnable) or None}``
    of ranks of a mesh this process spawned (-1: no GPU, no ``schedstat``; the CPU wanted is
    read here only if ``want``: the hang watchdog's); ranks on other hosts through their agents."""
    got = Completion()
    out: dict[int, tuple | None] = {}

    def check() -> None:
        if len(out) >= len(ranks) and not got.done():
            got.set_result(dict(out))

    def go() -> None:
        links: dict[int, tuple] = {}
        here: dict[int, int] = {}
        for r in ranks:
            pid = om.pids[r]
            if pid is None or r not in om.alive:
                out[r] = None
            elif om.links is None:
                here[pid] = r
            else:
                links.setdefault(id(om.links[r]), (om.links[r], {}))[1][pid] = r
        for pid, ticks, *rest in measure(list(here), want):
            out[here[pid]] = None if ticks < 0 else _usage(ticks, rest)
        for link, by_pid in links.values():
            def heard(msg: hw.Usages, by_pid=by_pid) -> None:
                for pid, ticks, *rest in msg.items:
                    if pid in by_pid:
                        out[by_pid[pid]] = None if ticks < 0 else _usage(ticks, rest)
                for r in by_pid.values():
                    out.setdefault(r, None)
                check()
            link.usage(list(by_pid), heard)
        check()

    rt.io.call_soon(go)
    return got


def _usage(ticks: int, rest: list) -> tuple[int, int, int, int, int, int]:
    rss, gpu, gpu_mib, wanted_ns, runnable = rest
    return ticks, rss, gpu, gpu_mib, wanted_ns, runnable
