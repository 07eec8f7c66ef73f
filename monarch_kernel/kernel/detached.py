"""The kernel's side of detached meshes: start a mesh host, attach to one, and turn what
the host forwards (rank output, deaths) into cell output and ``ProcessDied``."""

from __future__ import annotations

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
from .meshhost import MeshHost, info_path

START_TIMEOUT_S = 60.0


def spawn(session, name: str, n: int, env: dict):
    path = info_path(name)
    if os.path.exists(path):
        raise UsageError(f"a detached mesh {name!r} already runs; %mesh attach {name}, or %mesh stop {name} after attaching")
    log = open(os.path.join(os.path.dirname(path), f"monarch-mesh-{name}.log"), "ab")
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
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"no detached mesh named {name!r} (looked for {path}); start one with "
                         f"%mesh spawn -n 4 --detach {name}") from None
    try:
        os.kill(info["pid"], 0)
    except OSError:
        os.unlink(path)
        raise UsageError(f"detached mesh {name!r} is gone (its host, pid {info['pid']}, exited)") from None
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
        state = f"dead ({row['death']})" if row["death"] else "alive"
        last = last_lines.get((name, row["rank"]), "")
        out.append(f"  rank {row['rank']}: pid {row['pid']} on {row['host']}, {state}"
                   + (f"  | {last[:60]}" if last else ""))
    return "\n".join(out)
