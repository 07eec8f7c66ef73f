"""What a NAME on the command line is: a detached mesh (its record), a mesh or job of a
running kernel (that kernel's record), or a finished run (its copied history); and the rows
of ``monarch-kernel ls``.  It reads records and never starts or stops anything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..detached import listing, records
from ..kernel import live_record
from .output import Ambiguous, NotFound


@dataclass
class Target:
    """One thing a NAME names; ``kind``: ``detached``, ``mesh`` (a kernel's), ``job`` (a
    kernel's) or ``finished`` (only its history is left)."""

    name: str
    kind: str
    row: dict
    record: records.Record | None = None  # a detached mesh's
    kernel: dict = field(default_factory=dict)  # the live record of the kernel that holds it

    @property
    def owner(self) -> str:
        """``kernel ID (pid P)``: the kernel holding a mesh or job."""
        k = self.kernel
        return f"kernel {k.get('kernel_id') or '?'} (pid {k.get('pid')})"


def _when(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else None


def _detached() -> list[Target]:
    out = []
    for record in records.all_records():
        d = listing.describe(record)
        job = f"{record.job['kind']} job" if record.job else None
        row = {"name": record.name, "kind": "detached", "state": d["state"], "ranks": d["ranks"],
               "hosts": d["hosts"], "owner": f"host pid {record.pid}", "job": job,
               "attached": d["kernel"], "started": _when(d["started"]), "run": record.run}
        out.append(Target(record.name, "detached", row, record=record))
    return out


def _kernels() -> list[Target]:
    out = []
    for k in live_record.running_kernels():
        owner = f"kernel pid {k['pid']}"
        for m in k.get("meshes", []):
            if m.get("detached"):
                continue  # listed from its own record
            row = {"name": m["name"], "kind": "mesh", "state": m["state"], "ranks": m["ranks"], "hosts": m["hosts"],
                   "owner": owner, "job": m.get("job"), "attached": k.get("kernel_id") or None, "started": None,
                   "run": m.get("run")}
            out.append(Target(m["name"], "mesh", row, kernel=k))
        for j in k.get("jobs", []):
            row = {"name": j["name"], "kind": f"{j['kind']} job", "state": j["state"], "ranks": None,
                   "hosts": j["hosts"], "owner": owner, "job": j.get("slurm_job_id"),
                   "attached": k.get("kernel_id") or None, "started": None, "meshes": j.get("meshes", [])}
            out.append(Target(j["name"], "job", row, kernel=k))
    return out


def _finished(live: list[Target]) -> list[Target]:
    """Runs whose history is all that is left (their meshes and jobs are gone), one row per
    run (one spawn), newest first, and meshes spawned outside a kernel (a script's) whose
    history is still being written.  A live mesh's run is that mesh's row (one whose run is
    not known: its name's latest run)."""
    from .. import history

    out = []
    runs = {(t.name, t.row.get("run")) for t in live if t.row.get("run")}
    unknown = {t.name for t in live if not t.row.get("run")}
    newest: set[str] = set()
    for h in history.list_histories():  # the latest started first
        if (h.name, h.run) in runs:
            continue
        if h.name in unknown and h.name not in newest:
            newest.add(h.name)  # the live mesh's own run, as far as can be told
            continue
        row = {"name": h.name, "run": h.run, "kind": "finished" if h.state != "running" else h.kind, "state": h.state,
               "ranks": h.ranks, "hosts": h.hosts, "owner": "history", "job": None, "attached": None,
               "started": _when(h.first), "last": _when(h.last), "history": str(h.folder)}
        out.append(Target(h.name, "finished", row))
    return out


def everything() -> list[Target]:
    """Every mesh and job of this user: detached, of running kernels, then finished."""
    found = _detached() + _kernels()
    return found + _finished(found)


def held_by(target: Target, kernel: str) -> bool:
    """Whether ``target`` is held by ``kernel``: its pid, or its kernel id or the start of it."""
    k = target.kernel
    return bool(k) and (kernel == str(k.get("pid")) or str(k.get("kernel_id") or "").startswith(kernel))


def find(name: str, as_json: bool = False, kinds: tuple[str, ...] = ("detached", "mesh", "job", "finished"),
         kernel: str | None = None) -> Target:
    """What ``name`` names (of ``kinds``; ``kernel``: only a mesh or job of that kernel);
    ``NotFound`` saying what exists, ``Ambiguous`` when two kernels each hold one of that name."""
    every = [t for t in everything() if kernel is None or held_by(t, kernel)]
    for kind in kinds:  # in this order: a detached mesh before a kernel's mesh of the same name
        got = [t for t in every if t.name == name and t.kind == kind]
        if len(got) > 1 and kind in ("mesh", "job"):
            owners = "; ".join(f"{t.owner}, notebook {t.kernel.get('notebook') or '-'}" for t in got)
            raise Ambiguous(f"{len(got)} kernels each hold a {kind} named {name!r} ({owners}): say which with  "
                            f"--kernel PID", as_json)
        if got:
            return got[0]
    names = sorted({t.name for t in every if t.kind in kinds})
    where = f" in kernel {kernel}" if kernel is not None else ""
    raise NotFound(f"no mesh or job named {name!r}{where} (there are: {', '.join(names) or 'none'}); "
                   "monarch-kernel ls lists them", as_json)
