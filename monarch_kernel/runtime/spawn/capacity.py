"""How many more ranks a host can hold, read before a spawn forks anything: free memory at the
measured cost of an idle rank, the process limits (RLIMIT_NPROC, pid_max, threads-max, a
cgroup's pids.max) and the open files a controller or a template needs per rank.

It only reads /proc, /sys and rlimits, and never changes them (``limits.py`` raises the
open-files limit).  The costs below were measured on idle ranks (Linux, CPython 3.11):
``benchmarks/spawn.py`` (W6) and ``python -m benchmarks W11`` measure them again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..limits import RESERVE, open_files

# Linux's largest pid_max (PID_MAX_LIMIT on 64-bit): no host runs more tasks at once, whatever
# its settings, so a spawn of more ranks per host is refused even with the checks off.
PID_MAX_LIMIT = 1 << 22
# Threads of an idle rank (/proc/PID/status): its main thread, IO thread and helpers.  Each is
# a task: it takes a pid and counts against RLIMIT_NPROC and threads-max.
THREADS_PER_RANK = 5
# Open files the controller holds per rank: one link per rank and calling thread.  Whole-mesh
# calls stay flat (fan-out: under 100 for 512 ranks, tests/system/test_scale.py); a call_one to every
# rank took 1.2-1.5 per rank over same-host datagrams, and 3.75 through ZeroMQ (a socket, its
# mailbox, the rank's connection back), which is how ranks on other hosts are reached.  One a
# same-host rank: a spawn that cannot even hold one link a rank is refused; past that, a call
# that runs out fails at once with its own teaching error (test_scale).
CONTROLLER_FILES_PER_RANK = 1
CONTROLLER_FILES_PER_ZMQ_RANK = 4
CONTROLLER_FILES_PER_TEMPLATE = 2  # a template's pipe and socket, in the controller
TEMPLATE_FILES_PER_RANK = 3  # a rank's stdout, stderr and control pipe, in its template
TEMPLATE_FILES_BASE = 100  # what a template holds besides (launcher.py leaves it the same)


@dataclass(frozen=True)
class Shortfall:
    """Why a host cannot take the ranks asked of it: which ``limit`` runs out, how many more
    ranks it ``fits``, and the numbers in words (``why``)."""

    limit: str
    fits: int
    why: str

    def __str__(self) -> str:
        return self.why


class NoRoom(ValueError):
    """A host of a job refused a spawn before forking anything: it has no room (``shortfall``)."""

    def __init__(self, shortfall: Shortfall, host: str):
        super().__init__(f"{host}: {shortfall.why}")
        self.shortfall, self.host = shortfall, host


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    raise AssertionError


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs(controller: str) -> list[str]:
    """This process's cgroup folders for ``controller`` (v1) or the unified tree (v2), from its
    own to the root: a limit anywhere above binds too."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            base = f"/sys/fs/cgroup/{controller}"
            break
        if names == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            base = "/sys/fs/cgroup"
            break
    else:
        return []
    parts = [p for p in path.split("/") if p]
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def _cgroup_memory_room() -> tuple[int, str] | None:
    """Memory left under the tightest cgroup limit (usage less its reclaimable file cache)."""
    best = None
    for d in _cgroup_dirs("memory"):
        v2 = os.path.exists(os.path.join(d, "memory.max"))
        limit = _read_int(os.path.join(d, "memory.max" if v2 else "memory.limit_in_bytes"))
        used = _read_int(os.path.join(d, "memory.current" if v2 else "memory.usage_in_bytes"))
        if limit is None or used is None or limit >= 1 << 60:
            continue
        cache = 0
        try:
            with open(os.path.join(d, "memory.stat")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == ("inactive_file" if v2 else "total_inactive_file"):
                        cache = int(value)
        except (OSError, ValueError):
            pass
        room = max(0, limit - max(0, used - cache))
        if best is None or room < best[0]:
            best = (room, f"the memory limit of cgroup {d} is {_size(limit)}")
    return best


def _cgroup_pids_room() -> tuple[int, str] | None:
    best = None
    for d in _cgroup_dirs("pids"):
        limit = _read_int(os.path.join(d, "pids.max"))
        used = _read_int(os.path.join(d, "pids.current"))
        if limit is not None and used is not None and (best is None or limit - used < best[0]):
            best = (max(0, limit - used), f"cgroup {d} allows {limit:,} tasks and runs {used:,}")
    return best


def _host_tasks() -> int | None:
    """Every task (thread) on the host now: the total in /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return None


def _nproc_binds() -> int | None:
    """The soft RLIMIT_NPROC where Linux enforces it: not for root, nor for a process with
    CAP_SYS_ADMIN or CAP_SYS_RESOURCE (kernel/fork.c); None where it does not bind."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.getuid() == 0:
        return None
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        if caps & ((1 << 21) | (1 << 24)):
            return None
    except (OSError, StopIteration, ValueError):
        pass
    return soft


def _user_tasks() -> int:
    """Tasks of this real user (what RLIMIT_NPROC counts): threads of the processes it owns."""
    uid, total = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[17])
        except (OSError, ValueError, IndexError):
            continue
    return total


def host_shortfall(n: int, cost: int) -> Shortfall | None:
    """Why this host cannot run ``n`` more ranks of ``cost`` bytes each now (the tightest
    limit), or None when it can."""
    found: list[Shortfall] = []
    free = _meminfo("MemAvailable")
    if free is not None and cost > 0 and free // cost < n:
        found.append(Shortfall("memory", free // cost, (
            f"an idle rank takes about {_size(cost)} (MONARCH_KERNEL_RANK_MEMORY), so {n:,} ranks need "
            f"{_size(n * cost)}, and {_size(free)} is free (MemAvailable in /proc/meminfo)")))
    room = _cgroup_memory_room()
    if room is not None and cost > 0 and room[0] // cost < n:
        found.append(Shortfall("memory", room[0] // cost, (
            f"an idle rank takes about {_size(cost)} (MONARCH_KERNEL_RANK_MEMORY), so {n:,} ranks need "
            f"{_size(n * cost)}, and {room[1]}, with {_size(room[0])} left")))
    need = n * THREADS_PER_RANK
    tasks = _host_tasks()
    for path, what in (("/proc/sys/kernel/pid_max", "pid_max"), ("/proc/sys/kernel/threads-max", "threads-max")):
        limit = _read_int(path)
        if limit is not None and tasks is not None and limit - tasks < need:
            found.append(Shortfall("processes", max(0, limit - tasks) // THREADS_PER_RANK, (
                f"each rank runs {THREADS_PER_RANK} threads, so {n:,} ranks need {need:,} tasks, and the host runs "
                f"{tasks:,} of its {what} of {limit:,} ({path})")))
    pids = _cgroup_pids_room()
    if pids is not None and pids[0] < need:
        found.append(Shortfall("processes", pids[0] // THREADS_PER_RANK, (
            f"each rank runs {THREADS_PER_RANK} threads, so {n:,} ranks need {need:,} tasks, and {pids[1]}")))
    nproc = _nproc_binds()
    if nproc is not None:
        mine = 0 if need > nproc else _user_tasks()  # over the limit by itself: no need to count
        if mine + need > nproc:
            found.append(Shortfall("processes", max(0, nproc - mine) // THREADS_PER_RANK, (
                f"each rank runs {THREADS_PER_RANK} threads, so {n:,} ranks need {need:,} tasks, and your process "
                f"limit is {nproc:,} (`ulimit -u`, RLIMIT_NPROC)" + (f", of which you run {mine:,}" if mine else ""))))
    return min(found, key=lambda s: s.fits, default=None)


def controller_files_shortfall(local: int, zmq_ranks: int, templates: int) -> Shortfall | None:
    """Why this controller has too few open files left for ``local`` more same-host ranks,
    ``zmq_ranks`` reached through ZeroMQ (other hosts, or datagrams off) and ``templates`` new
    templates, or None."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = open_files()
    if soft == resource.RLIM_INFINITY or held < 0:
        return None
    room = soft - held - RESERVE
    need = (local * CONTROLLER_FILES_PER_RANK + zmq_ranks * CONTROLLER_FILES_PER_ZMQ_RANK
            + templates * CONTROLLER_FILES_PER_TEMPLATE)
    if need <= room:
        return None
    per = CONTROLLER_FILES_PER_ZMQ_RANK if zmq_ranks else CONTROLLER_FILES_PER_RANK
    return Shortfall("open files", max(0, room) // per, (
        f"the controller needs about {per} open file{'s' if per != 1 else ''} per rank ({need:,} for these), and it "
        f"holds {held:,} of "
        f"its limit of {soft:,} (`ulimit -n`, RLIMIT_NOFILE; {RESERVE} are kept free)"))


def template_files_shortfall(n: int, held_ranks: int) -> Shortfall | None:
    """Why one template (an agent's: it has one) cannot hold ``n`` more ranks beside the
    ``held_ranks`` it has: each takes three of its open files, or None."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the template raises its soft limit to this
    room = limit - TEMPLATE_FILES_BASE - TEMPLATE_FILES_PER_RANK * held_ranks
    if TEMPLATE_FILES_PER_RANK * n <= room:
        return None
    return Shortfall("open files", max(0, room) // TEMPLATE_FILES_PER_RANK, (
        f"the host's template needs {TEMPLATE_FILES_PER_RANK} open files per rank and holds {held_ranks:,} ranks "
        f"within its limit of {limit:,} (`ulimit -Hn` there, RLIMIT_NOFILE)"))
