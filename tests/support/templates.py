"""This test process's rank templates, found in /proc (``python -c SERVE fd ppid modules...``)."""

from __future__ import annotations

import os


def templates_of_this_process() -> list[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of each template this process started: the ones that fork ranks, and
    the warm standbys (argv[5:] names the modules a standby imports)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and len(argv) > 4 and argv[1] == b"-c" and argv[4] == str(me).encode():
            found.append((int(name), argv))
    return found
