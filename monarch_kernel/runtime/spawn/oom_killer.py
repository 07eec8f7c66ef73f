"""Naming an out-of-memory kill: a rank that died of SIGKILL is looked up in the kernel log
(``/dev/kmsg``: "Killed process PID", the memory cgroup it was in, what it held) and in its
memory cgroup's own counters (v2 ``memory.events``/``memory.peak``/``memory.max``, v1
``memory.oom_control``/``memory.max_usage_in_bytes``/``memory.limit_in_bytes``/``memory.failcnt``),
whichever can be read, so its death says "killed by the out-of-memory killer (it held 11.2 GiB;
the limit was 12 GiB)" instead of "signal 9".

Runs in the process that forked the rank's template (the rank's host), on the IO thread: it
reads a few small files and the kernel log's new records, never blocks, and claims an OOM kill
only when a counter or a log record says so.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import deque
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
KMSG = "/dev/kmsg"
KEEP = 256  # OOM kills remembered from the kernel log
_KILLED = re.compile(r"Killed process (\d+) \([^)]*\).*?anon-rss:(\d+)kB, file-rss:(\d+)kB, shmem-rss:(\d+)kB")
_OOM_KILL = re.compile(r"oom-kill:.*?task_memcg=([^,]*),.*?pid=(\d+)")
_USAGE = re.compile(r"memory: usage (\d+)kB, limit (\d+)kB")
_UNLIMITED = 1 << 60


@dataclass
class OomKill:
    """What is known of one OOM kill: bytes the rank held, the limit it hit (None: the host's
    memory, or unknown), and where that came from."""

    held: int | None
    limit: int | None
    source: str  # "kernel log", "cgroup v1 /x" or "cgroup v2 /x"
    machine: int | None = None  # the host's memory, for a kill with no cgroup limit

    def words(self) -> str:
        """``it held 11.2 GiB; the limit was 12 GiB``."""
        parts = []
        if self.held is not None:
            parts.append(f"it held {gib(self.held)}")
        if self.limit is not None:
            parts.append(f"the limit was {gib(self.limit)}")
        elif self.machine is not None:
            parts.append(f"no memory limit: the host has {gib(self.machine)}")
        return "; ".join(parts) or f"from the {self.source}"


def gib(n: int) -> str:
    """Bytes as ``11.2 GiB`` (``512 MiB`` under a GiB; whole numbers without a decimal)."""
    if n >= 1 << 30:
        v, unit = n / (1 << 30), "GiB"
    else:
        v, unit = n / (1 << 20), "MiB"
    return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"


class KernelLog:
    """The kernel log's OOM kills, read as new records arrive (the file stays open)."""

    def __init__(self, path: str = KMSG):
        self.path = path
        self._fd: int | None = None
        self.unreadable: str | None = None
        self.kills: deque[dict] = deque(maxlen=KEEP)
        self._usage: tuple[int, int] | None = None  # the last "memory: usage" line, for the kill after it
        self._memcg: dict[int, str] = {}  # pid -> task_memcg from its oom-kill line

    def read(self) -> None:
        if self.unreadable is not None:
            return
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                self.unreadable = f"{self.path}: {e.strerror}"
                return
        while True:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except BrokenPipeError:  # records overwritten before we read them: go on with the next
                continue
            except OSError as e:
                self.unreadable = f"{self.path}: {e.strerror}"
                return
            if not record:
                return
            self._parse(record.decode(errors="replace"))

    def _parse(self, record: str) -> None:
        head, _, text = record.partition(";")
        fields = head.split(",")
        try:
            at = int(fields[2]) / 1e6
        except (IndexError, ValueError):
            return
        m = _USAGE.search(text)
        if m:
            self._usage = (int(m[1]) * 1024, int(m[2]) * 1024)
            return
        m = _OOM_KILL.search(text)
        if m:
            self._memcg[int(m[2])] = m[1]
            return
        m = _KILLED.search(text)
        if m:
            pid = int(m[1])
            held = sum(int(x) for x in m.groups()[1:]) * 1024
            usage = self._usage
            self._usage = None
            self.kills.append({"pid": pid, "at": at, "held": held, "memcg": self._memcg.pop(pid, None),
                               "limit": usage[1] if usage and usage[1] < _UNLIMITED else None})

    def kill_of(self, pid: int, since: float) -> dict | None:
        """The newest OOM kill of ``pid`` logged after ``since`` (monotonic seconds)."""
        self.read()
        for k in reversed(self.kills):
            if k["pid"] == pid and k["at"] >= since:
                return k
        return None


def memory_cgroup(pid: int) -> tuple[int, str] | None:
    """``(1 or 2, path)`` of ``pid``'s memory cgroup, v1's memory controller first."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        _hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, path
        if controllers == "":
            v2 = path
    return (2, v2) if v2 is not None else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def _field(text: str | None, name: str) -> int | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def cgroup_dir(version: int, path: str, root: str = CGROUP_ROOT) -> str:
    base = os.path.join(root, "memory") if version == 1 else (
        os.path.join(root, "unified") if os.path.isdir(os.path.join(root, "unified")) else root)
    return os.path.join(base, path.lstrip("/"))


def counters(version: int, path: str, root: str = CGROUP_ROOT) -> dict:
    """A memory cgroup's own counters: ``oom_kill``, ``peak`` and ``limit`` (None where unknown)."""
    d = cgroup_dir(version, path, root)
    if version == 1:
        limit = _number(_read(os.path.join(d, "memory.limit_in_bytes")))
        return {"oom_kill": _field(_read(os.path.join(d, "memory.oom_control")), "oom_kill"),
                "failcnt": _number(_read(os.path.join(d, "memory.failcnt"))),
                "peak": _number(_read(os.path.join(d, "memory.max_usage_in_bytes"))),
                "limit": limit if limit is not None and limit < _UNLIMITED else None}
    return {"oom_kill": _field(_read(os.path.join(d, "memory.events")), "oom_kill"), "failcnt": None,
            "peak": _number(_read(os.path.join(d, "memory.peak"))),
            "limit": _number(_read(os.path.join(d, "memory.max")))}


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


class OomKiller:
    """Remembers each rank's memory cgroup and its OOM-kill count as it is forked (the
    baseline: a kill counted before the rank existed is not its), and names a SIGKILL that
    the kernel log or a counter attributes to the out-of-memory killer."""

    def __init__(self, kernel_log: KernelLog | None = None, root: str = CGROUP_ROOT):
        self.log = kernel_log or KernelLog()
        self.root = root
        self._ranks: dict[int, tuple[float, tuple[int, str] | None, int]] = {}  # pid -> (forked at, cgroup, kills)
        self._counted: dict[tuple[int, str], tuple[float, int]] = {}  # cgroup -> (when, kills): a spawn reads each once

    def forked(self, pid: int, local: bool = True) -> None:
        """Rank ``pid`` was just forked (``local``: on this host; others are their agent's)."""
        if not local:
            return
        now = time.monotonic()
        group = memory_cgroup(pid)
        kills = 0
        if group is not None:
            at, kills = self._counted.get(group, (0.0, 0))
            if now - at > 1.0:
                kills = counters(*group, self.root)["oom_kill"] or 0
                self._counted[group] = (now, kills)
        self._ranks[pid] = (now - 1.0, group, kills)

    def words(self, pid: int, local: bool, sig: int | None) -> str:
        """``it held 2 GiB; the limit was 2 GiB`` if ``pid`` (dead of ``sig``, on this host
        if ``local``) was killed by the OOM killer, else ``""``."""
        if not local or sig != signal.SIGKILL:
            self.forget(pid)
            return ""
        kill = self.explain(pid)
        return kill.words() if kill is not None else ""

    def explain(self, pid: int) -> OomKill | None:
        """How ``pid`` (dead of SIGKILL, just now) was killed by the OOM killer; None if
        nothing readable says it was."""
        since, group, before = self._ranks.pop(pid, (0.0, None, 0))
        logged = self.log.kill_of(pid, since)
        if logged is not None and logged["memcg"]:  # the group it was killed in (it may have moved)
            version = group[0] if group else (1 if os.path.isdir(os.path.join(self.root, "memory")) else 2)
            if (version, logged["memcg"]) != group:
                group, before = (version, logged["memcg"]), 0
        c = counters(*group, self.root) if group else {}
        counted = c.get("oom_kill") is not None and c["oom_kill"] > before
        if logged is None and not counted:
            return None
        held = logged["held"] if logged is not None else c.get("peak")
        limit = c.get("limit") or (logged or {}).get("limit")
        source = "kernel log" if logged is not None else f"cgroup v{group[0]} {group[1]}" if group else "?"
        return OomKill(held, limit, source, None if limit else _machine_memory())

    def forget(self, pid: int) -> None:
        self._ranks.pop(pid, None)
