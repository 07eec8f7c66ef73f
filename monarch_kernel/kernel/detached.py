"""The kernel's side of detached meshes: start a mesh host, attach to one, notice one whose
host died, and turn what the host forwards (rank output, deaths) into cell output and
``ProcessDied``.  Runs in the kernel; the host itself is ``detached/host.py``."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from IPython.core.error import UsageError

from ..actor.actor_mesh import ActorMesh
from ..actor.port import Port
from ..actor.proc_mesh import ProcMesh
from ..actor.spawn_checks import check_env, check_mesh_name, check_room
from ..console.console import Console
from ..detached import records
from ..detached.host import MeshHost
from ..detached.listing import kernel_id
from ..job import tunnels
from ..job.agents import route_to
from ..runtime import CurveKeys, DeathInfo, Runtime, config

START_TIMEOUT_S = config.seconds("detached_start_timeout")
_joined: dict = {}  # the ssh control sockets this kernel reaches hosts through -> what undoes its forwards


def _gone(record: records.Record) -> str:
    return (f"its host process (pid {record.pid}) is no longer running (killed, out of memory "
            f"or a reboot), so its ranks are gone too")


def spawn(session, name: str, n: int, env: dict, job: dict | None = None):
    """Start detached mesh ``name`` of ``n`` ranks (per host of ``job``, a ``job.spec()``).
    Its arguments, and this host's room for its ranks, are checked here, before its host
    process starts (a job's hosts check theirs when that process spawns on them)."""
    check_mesh_name(name, "%mesh spawn --detach")
    env = check_env(env)
    check = config.check_limits()
    if job is None:
        check_room({"ranks": n}, n, 1, local=True, check=check, per_template=Runtime.current().per_template)
    record = records.read(name)
    if record is not None:
        if record.alive():
            raise UsageError(f"a detached mesh {name!r} already runs; "
                             f"%mesh attach {name}, or %mesh stop {name} after attaching")
        records.forget(name)
        print(f"detached mesh {name!r} had a stale record: {_gone(record)}; removed it and starting anew")
    log = open(records.log_path(name), "ab")
    # -c, not -m: MeshHost must live in its importable module, not in __main__.
    proc = subprocess.Popen(
        [sys.executable, "-c", "from monarch_kernel.detached.host import main; main()", name, str(n)],
        stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
    log.close()
    assert proc.stdin is not None  # stdin=PIPE
    proc.stdin.write((json.dumps({"env": env, "job": job, "check_limits": check}) + "\n").encode())
    proc.stdin.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while records.read(name) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"the host of detached mesh {name!r} exited with code {proc.returncode}; "
                               f"see {records.log_path(name)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"timed out after {START_TIMEOUT_S:g} s waiting for detached mesh {name!r} to start")
        time.sleep(0.05)
    return attach(session, name).procs


def this_kernel() -> dict:
    """What names this kernel to a detached mesh's host, so that a restarted kernel of the
    same notebook is known as such: Jupyter's kernel id (kept across a restart; the name of
    its connection file) and the notebook's path (``JPY_SESSION_NAME``, which Jupyter Server
    gives a notebook's kernels); "" where there is none."""
    return {"kernel_id": kernel_id(), "notebook": os.environ.get("JPY_SESSION_NAME", "")}


@dataclass
class Attached:
    """A detached mesh this kernel attached, and the kernel that had it before (or None)."""

    procs: ProcMesh
    before: dict | None

    def line(self) -> str:
        """What ``%mesh attach`` says it did, in one line."""
        n = len(self.procs)
        said = f"attached detached mesh {self.procs.name!r}: {n} rank{'s' if n != 1 else ''}"
        b, me = self.before, this_kernel()
        if b is None:
            return said
        if b.get("pid") == os.getpid():
            return f"{said} (again)"
        if me["kernel_id"] and b.get("kernel_id") == me["kernel_id"]:
            return f"{said}, as this notebook's kernel had it before its restart"
        if me["notebook"] and b.get("notebook") == me["notebook"]:
            return f"{said}, as this notebook's earlier kernel had it"
        if b.get("running"):
            other = f"kernel {b['kernel_id']} " if b.get("kernel_id") else "the kernel "
            return (f"{said}; it was attached to another kernel, {other}(pid {b['pid']}), "
                    "which no longer gets its output")
        return said


def attach(session, name: str) -> Attached:
    record = records.read(name)
    if record is None:
        raise UsageError(f"no detached mesh named {name!r} (looked for {records.info_path(name)}); start one with "
                         f"%mesh spawn -n 4 --detach {name}")
    if not record.alive():
        records.forget(name)
        raise UsageError(f"detached mesh {name!r} is gone: {_gone(record)}. Its record was removed; "
                         f"start it again with  %mesh spawn -n 4 --detach {name}")
    rt = Runtime.current()
    ref, host_ref = record.ref, record.host_ref
    if record.curve is not None:  # its ranks are on a job's hosts: speak that job's Curve keys
        keys = CurveKeys.from_wire([k.encode() for k in record.curve])
        try:
            rt.use_job_keys(keys)
        except RuntimeError as e:
            raise UsageError(f"cannot attach {name!r} here: {e}; attach it from a kernel without a job "
                             "of its own (a new notebook)") from None
        if record.routes:  # out of cluster: its hosts reach this kernel only through its host's ssh
            _through_ssh(rt, name, record.routes, keys)
        elif rt.net_address is None:
            rt.listen(route_to(ref.addresses[0][len("tcp://"):].rsplit(":", 1)[0]), keys)
    rt.trust([ref.id, host_ref.id], bytes.fromhex(record.key))
    procs = ProcMesh.from_ref(ref)
    consoles = ActorMesh.from_ref(procs, record.console, "console", Console)
    host = ActorMesh.from_ref(ProcMesh.from_ref(host_ref), record.host, "meshhost", MeshHost)

    def forwarded(part) -> None:  # on the IO thread
        message = part.load()
        if message[0] == "line":
            session.sink(*message[1:])
        elif message[0] == "death":
            rt.rank_died(*message[1:])

    port_id = rt.open_port(forwarded, once=False)
    before = host.attach.call_one(Port(rt.port_address, port_id), os.getpid(), this_kernel()).get(timeout=30)
    for row in host.status.call_one().get(timeout=30):
        if row["death"]:  # it died while no kernel was attached
            rt.rank_died(ref.id, row["rank"], DeathInfo(ref.name, row["rank"], row["pid"] or 0, row["host"], None, None,
                                                       [f"(died while detached: {row['death']})"]))
    session.add(procs, consoles, host=host)
    return Attached(procs, before)


def _through_ssh(rt, name: str, routes: dict, keys: CurveKeys) -> None:
    """Listen on loopback, forward that port to each host through the ssh connections the
    detached mesh's host process holds, and reach the hosts through them (once per set of them)."""
    masters = tuple(sorted(ctl for _host, ctl in routes.values()))
    if masters in _joined:
        return
    if rt.net_address is None:
        rt.listen("127.0.0.1", keys)
    elif not rt.net_address.startswith("tcp://127.0.0.1:"):
        raise UsageError(f"cannot attach {name!r} here: its hosts reach a kernel only through ssh, on loopback, "
                         f"and this kernel listens on {rt.net_address}; attach it from a new notebook")
    undo = tunnels.join(rt, routes)
    _joined[masters] = undo
    atexit.register(undo)


def stop(name: str, host) -> bool:
    """End a detached mesh through its host; False (and cleaned up) if the host was gone."""
    record = records.read(name)
    alive = record is not None and record.alive()
    if alive:
        host.stop_mesh.call_one().get(timeout=60)
    records.forget(name)
    return alive


def listing(attached: set) -> list[str]:
    """Lines for ``%mesh list`` about detached meshes not attached here; gone ones are removed."""
    out = []
    for record in records.all_records():
        if record.name in attached:
            continue
        if record.alive():
            where = f" on a {record.job['kind']} job" if record.job else ""
            out.append(f"  {record.name}: detached{where}, running (host pid {record.pid}); "
                       f"%mesh attach {record.name}")
        else:
            records.forget(record.name)
            out.append(f"  {record.name}: detached, gone (host pid {record.pid} exited); its record was removed")
    return out
