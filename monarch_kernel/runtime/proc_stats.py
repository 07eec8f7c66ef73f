"""CPU time and resident memory of ranks, for ``%mesh top`` and the panel's sparklines: read
from /proc on the rank's own host, by the controller for local ranks and by the host's agent
for ranks on other hosts (the controller cannot read another host's /proc).  Nothing is
sampled unless asked: an idle kernel sends nothing.
"""

from __future__ import annotations

import os

from . import host_wire as hw
from .completion import Completion

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


def usages(pids: list[int]) -> hw.Usages:
    return hw.Usages(0, [(p, *(usage(p) or (-1, -1))) for p in pids])


def sample(rt, om, ranks: list[int]) -> Completion:
    """From any thread: ``{rank: (ticks, rss bytes) or None}`` of ranks of a mesh this process
    spawned; ranks on other hosts through their agents."""
    got = Completion()
    out: dict[int, tuple[int, int] | None] = {}

    def check() -> None:
        if len(out) >= len(ranks) and not got.done():
            got.set_result(dict(out))

    def go() -> None:
        links: dict[int, tuple] = {}
        for r in ranks:
            pid = om.pids[r]
            if om.links is None or pid is None or r not in om.alive:
                out[r] = usage(pid) if r in om.alive else None
            else:
                links.setdefault(id(om.links[r]), (om.links[r], {}))[1][pid] = r
        for link, by_pid in links.values():
            def heard(msg: hw.Usages, by_pid=by_pid) -> None:
                for pid, ticks, rss in msg.items:
                    if pid in by_pid:
                        out[by_pid[pid]] = None if ticks < 0 else (ticks, rss)
                for r in by_pid.values():
                    out.setdefault(r, None)
                check()
            link.usage(list(by_pid), heard)
        check()

    rt.io.call_soon(go)
    return got
