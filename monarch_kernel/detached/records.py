"""The record a detached mesh's host leaves in Jupyter's runtime directory: what a kernel
needs to reconnect (addresses, actor ids, the job key) in a 0600 file, and whether the host
that wrote it still runs.  Read by kernels and written by the host; it never starts
anything.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass

from ..actor.spawn_checks import check_mesh_name, mesh_name_problem
from ..runtime import MeshRef, private_files

PREFIX = "monarch-mesh-"


def runtime_dir() -> str:
    """Jupyter's runtime directory, created (0700) if this machine never ran Jupyter, and
    checked to be this user's alone: a record there holds a job's key, and a kernel attaches
    to what a record says."""
    from jupyter_core.paths import jupyter_runtime_dir

    return private_files.private_dir(jupyter_runtime_dir())


def info_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{PREFIX}{check_mesh_name(name, 'a detached mesh')}.json")


def log_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{PREFIX}{check_mesh_name(name, 'a detached mesh')}.log")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), so a reused pid is not taken for it;
    None if it is not running (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Record:
    """One detached mesh: its host process and how to reach its ranks and actors."""

    name: str
    pid: int
    start: int | None
    key: str  # the job key, hex
    mesh: list  # MeshRef.to_wire() of the ranks
    host_mesh: list  # MeshRef.to_wire() of the host process itself
    console: str  # actor id of the consoles
    host: str  # actor id of the MeshHost actor
    curve: list | None = None  # the job's Curve keys (z85 text) when its ranks are on other hosts
    job: dict | None = None  # job.spec() of the job its ranks run on, if any
    routes: dict | None = None  # hosts beyond this controller's reach: address -> [name, ssh control socket]
    run: str | None = None  # the history run its ranks are recorded under (``monarch_kernel.history``)

    @property
    def ref(self) -> MeshRef:
        return MeshRef.from_wire(self.mesh)

    @property
    def host_ref(self) -> MeshRef:
        return MeshRef.from_wire(self.host_mesh)

    def alive(self) -> bool:
        """Whether the host that wrote this still runs (same pid, same start time)."""
        now = start_time(self.pid) if self.pid > 0 else None
        return now is not None and (self.start is None or now == self.start)

    def write(self) -> None:
        """Atomically, 0600: the key must never be readable by anyone else."""
        private_files.replace_file(info_path(self.name), json.dumps(asdict(self)).encode())


def read(name: str) -> Record | None:
    """The record of detached mesh ``name``, or None (also for a name no mesh can have); an
    unreadable one reads as a dead host."""
    if mesh_name_problem(name) is not None:
        return None
    try:
        return Record(**json.loads(private_files.read_file(info_path(name))))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return Record(name, 0, None, "", [], [], "", "")


def forget(name: str) -> None:
    """Remove a detached mesh's record and log (its host is gone or was stopped)."""
    for path in (info_path(name), log_path(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def all_records() -> list[Record]:
    """Every detached mesh recorded in Jupyter's runtime directory."""
    out = []
    for path in sorted(glob.glob(os.path.join(runtime_dir(), f"{PREFIX}*.json"))):
        record = read(os.path.basename(path)[len(PREFIX):-len(".json")])
        if record is not None:
            out.append(record)
    return out
