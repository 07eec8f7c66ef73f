"""The kernel's side of detached meshes: start a mesh host, attach to one, and turn what
the host forwards (rank output, deaths) into cell output and ``ProcessDied``."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

from IPython.core.error import UsageError

from ..actor.actor_mesh import ActorMesh, endpoint_names
from ..actor.port import Port
from ..mesh.proc_mesh import ProcMesh
from ..mesh.shape import Shape
from ..runtime.context import MeshRef
from ..runtime.process import Runtime
from .console import Console
from .meshhost import MeshHost, info_path, log_path, runtime_dir, start_time

START_TIMEOUT_S = 60.0


def read_record(name: str) -> dict | None:
    """The record a detached mesh's host left, or None."""
    try:
        with open(info_path(name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"name": name, "pid": 0, "start": None, "broken": True}


def host_alive(info: dict) -> bool:
    """Whether the host process that wrote ``info`` still runs (same pid, same start time)."""
    pid = info.get("pid") or 0
    if pid <= 0 or info.get("broken"):
        return False
    now = start_time(pid)
    return now is not None and (info.get("start") is None or now == info["start"])


def forget(name: str) -> None:
    """Remove a detached mesh's record and log (its host is gone or was stopped)."""
    for path in (info_path(name), log_path(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def records() -> list[dict]:
    """Every detached mesh recorded in Jupyter's runtime directory, with ``alive`` set."""
    out = []
    for path in sorted(glob.glob(os.path.join(runtime_dir(), "monarch-mesh-*.json"))):
        name = os.path.basename(path)[len("monarch-mesh-"):-len(".json")]
        info = read_record(name)
        if info is not None:
            out.append({**info, "name": name, "alive": host_alive(info)})
    return out


def _gone(info: dict) -> str:
    return (f"its host process (pid {info.get('pid')}) is no longer running (killed, out of memory "
            f"or a reboot), so its ranks are gone too")


def spawn(session, name: str, n: int, env: dict):
    path = info_path(name)
    info = read_record(name)
    if info is not None:
        if host_alive(info):
            raise UsageError(f"a detached mesh {name!r} already runs; %mesh attach {name}, or %mesh stop {name} after attaching")
        forget(name)
        print(f"detached mesh {name!r} had a stale record: {_gone(info)}; removed it and starting anew")
    log = open(log_path(name), "ab")
    # -c, not -m: MeshHost must live in its importable module, not in __main__.
    proc = subprocess.Popen([sys.executable, "-c", "from monarch_kernel.kernel.meshhost import main; main()", name, str(n)],
                            stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
    log.close()
    proc.stdin.write((json.dumps(env) + "\n").encode())
    proc.stdin.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"the host of detached mesh {name!r} exited with code {proc.returncode}; "
                               f"see {log.name}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"timed out after {START_TIMEOUT_S:g} s waiting for detached mesh {name!r} to start")
        time.sleep(0.05)
    return attach(session, name)


def _ref(fields) -> MeshRef:
    mesh_id, mesh_name, dims, addresses, owner, hosts = fields
    return MeshRef(mesh_id, mesh_name, tuple(tuple(d) for d in dims), tuple(addresses), owner, tuple(hosts))


def attach(session, name: str) -> ProcMesh:
    path = info_path(name)
    info = read_record(name)
    if info is None:
        raise UsageError(f"no detached mesh named {name!r} (looked for {path}); start one with "
                         f"%mesh spawn -n 4 --detach {name}")
    if not host_alive(info):
        forget(name)
        raise UsageError(f"detached mesh {name!r} is gone: {_gone(info)}. Its record was removed; "
                         f"start it again with  %mesh spawn -n 4 --detach {name}")
    rt = Runtime.current()
    ref, host_ref = _ref(info["mesh"]), _ref(info["host_mesh"])
    rt.signer.add_key([ref.id, host_ref.id], bytes.fromhex(info["key"]))
    shape = Shape.full(ref.dims)
    procs = ProcMesh(ref, shape)
    consoles = ActorMesh(ref, info["console"], "console", "Console", endpoint_names(Console), shape)
    host = ActorMesh(host_ref, info["host"], "meshhost", "MeshHost", endpoint_names(MeshHost), Shape.full({}))

    def forwarded(part) -> None:  # on the IO thread
        message = part.load()
        if message[0] == "line":
            session.sink(*message[1:])
        elif message[0] == "death":
            rt.rank_died(*message[1:])

    port_id = rt.ports.open(forwarded, once=False)
    host.attach.call_one(Port(rt.address, port_id), os.getpid()).get(timeout=30)
    for row in host.status.call_one().get(timeout=30):
        if row["death"]:  # it died while no kernel was attached
            rt.dead.setdefault((ref.id, row["rank"]), _death(ref, row))
    session.meshes[ref.name] = (procs, consoles)
    session.hosts[ref.name] = host
    session.current = ref.name
    return procs


def _death(ref: MeshRef, row: dict):
    from ..runtime.failure import DeathInfo

    return DeathInfo(ref.name, row["rank"], row["pid"] or 0, row["host"], None, None,
                     [f"(died while detached: {row['death']})"])


def status_text(name: str, rows: list[dict], last_lines: dict) -> str:
    out = [f"mesh {name} (detached): {len(rows)} ranks"]
    for row in rows:
        if row["death"]:
            state = f"dead ({row['death']})"
        elif not row.get("responding", True):
            state = f"not responding ({row.get('silent_s', 0):.0f} s; %mesh restart replaces it)"
        else:
            state = "alive"
        last = last_lines.get((name, row["rank"]), "")
        out.append(f"  rank {row['rank']}: pid {row['pid']} on {row['host']}, {state}"
                   + (f"  | {last[:60]}" if last else ""))
    return "\n".join(out)
