"""Process-tree plumbing for the template (and the ranks it forks): dying with the parent,
adopting orphans, listing and ending children.  Linux ``prctl`` where there is one; elsewhere
each call does nothing and the heartbeat still ends what is left.  It holds no state.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent goes; exit if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the heartbeat still covers us
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def become_subreaper() -> None:
    """Orphaned descendants come to us instead of PID 1, so they can be ended."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def children_of_self() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # no /proc children file: scan every process's parent
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            found.append(int(name))
                except (OSError, ValueError, IndexError):
                    continue
        return found


def end_tree(pgid: int) -> None:
    """SIGKILL a rank's process group (its subprocesses share it unless they left)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
