"""Detached meshes as the Jupyter Server extension sees them, with no kernel attached:
which exist, their ranks' pids and hosts, when they started, which kernel has each
attached, and stopping one.  ``python -m monarch_kernel.detached.listing list|stop NAME``
runs a short-lived controller for what needs the mesh's own connection, so the server
process itself never becomes one.  It never starts a mesh.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ..runtime import private_files
from . import records

ATTACHED_PREFIX = "monarch-panel-attached-"  # not records.PREFIX: these are not mesh records


def kernel_id() -> str:
    """This kernel's id, as Jupyter Server names it (its connection file is kernel-ID.json);
    "" outside a kernel."""
    try:
        from ipykernel.kernelapp import IPKernelApp
    except ImportError:
        return ""
    if not IPKernelApp.initialized():
        return ""
    name = os.path.basename(IPKernelApp.instance().connection_file or "")
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-"):-len(".json")]
    return ""


def _attached_path(name: str) -> str:
    return os.path.join(records.runtime_dir(), f"{ATTACHED_PREFIX}{name}.json")


def mark_attached(name: str) -> None:
    """Note (0600, atomically) that this kernel process has detached mesh ``name`` attached."""
    note = {"kernel_id": kernel_id(), "pid": os.getpid(), "start": records.start_time(os.getpid())}
    private_files.replace_file(_attached_path(name), json.dumps(note).encode())


def unmark_attached(name: str) -> None:
    """Take this process's note off (only if it is this process's)."""
    path = _attached_path(name)
    try:
        mine = json.loads(private_files.read_file(path)).get("pid") == os.getpid()
        if mine:
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


def attached_kernel(name: str) -> str | None:
    """The id of the kernel that has ``name`` attached, if that kernel still runs."""
    try:
        note = json.loads(private_files.read_file(_attached_path(name)))
        pid, start = int(note["pid"]), note.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = records.start_time(pid)
    if now is None or (start is not None and now != start):
        return None
    return str(note.get("kernel_id") or "") or None


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def started_at(record: records.Record) -> float | None:
    """When the mesh's host process started, in seconds since the epoch."""
    if record.start is None:
        return None
    try:
        return round(_boot_time() + record.start / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError):
        return None


def describe(record: records.Record) -> dict:
    """What ``GET /monarch/meshes`` says of one record, without talking to its host."""
    try:
        ref = record.ref
        ranks, hosts = ref.size, sorted(set(ref.hosts)) or [os.uname().nodename]
    except ValueError:  # an unreadable record
        ranks, hosts = 0, []
    alive = record.alive()
    return {"name": record.name, "state": "running" if alive else "gone", "ranks": ranks, "hosts": hosts,
            "host_pid": record.pid, "pids": [], "started": started_at(record),
            "kernel": attached_kernel(record.name) if alive else None}


def find(name: str) -> records.Record | None:
    return next((r for r in records.all_records() if r.name == name), None)


# ---------------------------------------------------------------- the short-lived controller


def _host(record: records.Record):
    from ..actor.actor_mesh import ActorMesh
    from ..actor.proc_mesh import ProcMesh
    from ..runtime import Runtime
    from .host import MeshHost

    Runtime.current().trust([record.ref.id, record.host_ref.id], bytes.fromhex(record.key))
    return ActorMesh.from_ref(ProcMesh.from_ref(record.host_ref), record.host, "meshhost", MeshHost)


def mesh(record: records.Record):
    """A handle on the detached mesh's ranks from this process (a short-lived controller): it
    can be called and its stacks read, not stopped (``stop`` does that through its host)."""
    from ..actor.proc_mesh import ProcMesh

    _host(record)  # trusts the mesh's key
    return ProcMesh.from_ref(record.ref)


def rank_rows(record: records.Record, timeout: float = 10) -> list[dict]:
    """The ranks' rows as the mesh's host reports them (pid, host, state)."""
    return _host(record).status.call_one().get(timeout=timeout)


def usage(record: records.Record, timeout: float = 10) -> tuple[dict, dict]:
    """Each rank's CPU ticks, memory and GPU, and its pid, as the mesh's host samples them."""
    got, pids = _host(record).usage.call_one().get(timeout=timeout)
    return {int(r): u for r, u in got.items()}, {int(r): p for r, p in pids.items()}


def stop(record: records.Record, timeout: float = 60) -> None:
    """End the mesh's ranks and its host, then remove its record and log."""
    _host(record).stop_mesh.call_one().get(timeout=timeout)
    deadline = time.monotonic() + 10
    while record.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    records.forget(record.name)


def main(argv: list[str] | None = None) -> int:
    """``list [NAME...]``: one JSON object, name to ranks' pids, hosts and dead ranks, for
    each running record (or only those named); ``stop NAME``: stop it.  Exit status 2: no
    such mesh."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["list"]:
        out: dict[str, dict] = {}
        for record in records.all_records():
            if not record.alive() or (args[1:] and record.name not in args[1:]):
                continue
            try:
                rows = rank_rows(record)
                out[record.name] = {"pids": [row["pid"] for row in rows],
                                    "hosts": sorted({row["host"] for row in rows if row["host"]}),
                                    "dead": [row["rank"] for row in rows if row["death"]]}
            except (TimeoutError, OSError, ValueError) as e:
                out[record.name] = {"error": str(e)}
        print(json.dumps(out))
        return 0
    if len(args) == 2 and args[0] == "stop":
        found = find(args[1])
        if found is None or not found.alive():
            if found is not None:
                records.forget(found.name)
            print(json.dumps({"message": f"no running detached mesh named {args[1]!r}"}))
            return 2
        stop(found)
        print(json.dumps({"message": f"stopped detached mesh {args[1]!r}"}))
        return 0
    print("usage: python -m monarch_kernel.detached.listing list [NAME...] | stop NAME", file=sys.stderr)
    return 1


if __name__ == "__main__":
    code = main()
    from ..runtime import Runtime

    rt = Runtime.existing()
    if rt is not None:
        rt.shutdown()
    sys.exit(code)
