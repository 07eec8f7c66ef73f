"""What a running kernel drives, in a 0600 file of Jupyter's runtime directory
(``monarch-kernel-PID.json``), so that ``monarch-kernel ls`` finds its meshes and jobs with
no connection to it: their names, ranks, hosts and state, and the kernel's connection file
(``monarch-kernel attach`` opens a console on it).  The kernel writes it when its meshes or
jobs change; a record whose kernel is gone is stale and is removed by its reader.  It never
holds a key.
"""

from __future__ import annotations

import glob
import json
import os

from ..detached import records
from ..detached.listing import kernel_id
from ..runtime import Runtime, private_files

PREFIX = "monarch-kernel-"


def path(pid: int | None = None) -> str:
    return os.path.join(records.runtime_dir(), f"{PREFIX}{os.getpid() if pid is None else pid}.json")


def _connection_file() -> str:
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return ""
    return str(IPKernelApp.instance().connection_file or "") if IPKernelApp.initialized() else ""


class LiveRecord:
    """This kernel's record; ``note(session)`` rewrites it when what it says changed."""

    def __init__(self) -> None:
        self._said = ""

    def note(self, session) -> None:
        meshes, rt = [], Runtime.current()
        seen = set()
        jobs = []
        on_job = {}  # mesh name -> the job it runs on
        for name, job in session.jobs.jobs.items():
            on = session.jobs.meshes_of(name)
            on_job.update(dict.fromkeys(on, name))
            jobs.append({"name": name, "kind": job.kind, "state": "running" if job.active else "killed",
                         "hosts": session.jobs.hosts(job), "slurm_job_id": getattr(job, "job_id", None),
                         "meshes": on})
        for name, (procs, _consoles) in session.meshes.items():
            seen.add(procs.ref.id)
            meshes.append({"name": name, "ranks": len(procs), "hosts": sorted({str(h) for h in procs.ref.hosts if h}),
                           "state": "stopped" if procs.stopped else "running", "detached": name in session.hosts,
                           "job": on_job.get(name), "dead": len(procs.dead_ranks()), "run": _run(procs)})
        for om in rt.owned_meshes():  # spawned with the API in a cell
            if om.ref.id in seen or om.stopping:
                continue
            meshes.append({"name": om.ref.name, "ranks": om.ref.size,
                           "hosts": sorted({str(h) for h in om.ref.hosts if h}), "state": "running",
                           "detached": False, "job": on_job.get(om.ref.name), "dead": om.ref.size - len(om.alive),
                           "run": _run(om)})
        me = os.getpid()
        said = json.dumps({"pid": me, "start": records.start_time(me), "kernel_id": kernel_id(),
                           "connection_file": _connection_file(), "notebook": os.environ.get("JPY_SESSION_NAME", ""),
                           "meshes": meshes, "jobs": jobs})
        if said != self._said:
            private_files.replace_file(path(), said.encode())
            self._said = said

    def close(self) -> None:
        try:
            os.unlink(path())
        except FileNotFoundError:
            pass
        self._said = ""


def _run(mesh) -> str | None:
    """The history run ``mesh`` (a ProcMesh, or an OwnedMesh: its ``ref``) is recorded under."""
    from ..history import current_run

    return current_run(mesh)


def running_kernels() -> list[dict]:
    """The records of the kernels that still run (stale ones are removed)."""
    out = []
    for p in sorted(glob.glob(os.path.join(records.runtime_dir(), f"{PREFIX}*.json"))):
        try:
            got = json.loads(private_files.read_file(p))
            pid, start = int(got["pid"]), got.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        now = records.start_time(pid)
        if now is None or (start is not None and now != start):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            continue
        out.append(got)
    return out
