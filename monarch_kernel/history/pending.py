"""Writer processes still writing for a controller that has exited.  A controller's exit does
not wait for its writer process (``writer_process``), so a query from another process (a
fresh kernel, the command line) started at once could miss the last rows: each writer
process is marked under ``root/.writing/`` while it lives, and a query on this host first
waits, for a few seconds at most, for those whose controller is gone.
"""

from __future__ import annotations

import os
import pathlib
import time

from ..runtime.hosting import config, private_files
from . import places
from .listing import alive

FOLDER = ".writing"
WAIT_S = config.seconds("history_pending_wait")  # a query waits this long at most for a gone controller's writer


def mark(root: pathlib.Path, writer: int) -> pathlib.Path | None:
    """Mark this process's writer process ``writer`` (it unmarks itself when it exits)."""
    try:
        folder = root / FOLDER
        private_files.private_dir(str(root), parents=False)
        private_files.private_dir(str(folder), parents=False)
        path = folder / f"{os.getpid()}-{writer}@{places.safe(places.host_name())}"
        private_files.write_file(str(path), b"")
        return path
    except OSError:  # no marker: a query elsewhere may only miss the very last rows
        return None


def unmark(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    return alive(pid, places.host_name())


def _waited_for(root: pathlib.Path) -> list[tuple[pathlib.Path, int]]:
    """(marker, writer pid) of this host's writers whose controller is gone; stale markers
    (their writer gone too, killed) are removed."""
    folder = root / FOLDER
    host = "@" + places.safe(places.host_name())
    out: list[tuple[pathlib.Path, int]] = []
    try:
        names = [n for n in os.listdir(folder) if n.endswith(host)]
    except OSError:
        return out
    for name in names:
        try:
            controller, writer = (int(x) for x in name[:-len(host)].split("-"))
        except ValueError:
            continue
        if _alive(controller):
            continue  # a live controller's rows are its own to flush
        if _alive(writer):
            out.append((folder / name, writer))
        else:
            unmark(str(folder / name))
    return out


def wait_written(root: pathlib.Path, timeout: float = WAIT_S) -> None:
    """Return once every writer process of a gone controller on this host has written what it
    was given under ``root`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while (waiting := _waited_for(root)) and time.monotonic() < deadline:
        if not any(path.exists() and _alive(pid) for path, pid in waiting):
            return
        time.sleep(0.05)
