"""What is left of a rank to end: its process, killed where it runs (here, or through its
host's agent), and its socket files in the run directory once it has exited.  The launcher's
helpers; they decide nothing about why a rank ends.
"""

from __future__ import annotations

import glob
import os
import signal

from .owned_mesh import OwnedMesh


def kill_rank(om: OwnedMesh, rank: int) -> None:
    """SIGKILL rank ``rank`` of ``om`` where it runs: here, or through its host's agent."""
    pid = om.pids[rank]
    if pid is None:
        return
    if om.links is not None:
        om.links[rank].kill(pid)
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def remove_inboxes(address: str) -> None:
    """Remove the socket files of a rank that exited: its main inbox, its actors' and its
    threads' (they all live under the rank's address)."""
    if not address.startswith("ipc://"):
        return
    base = address[len("ipc://"):]
    for path in [base, base + "d", *glob.glob(glob.escape(base) + ".*")]:  # "d": its datagrams (datagram.py)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
