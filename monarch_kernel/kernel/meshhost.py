"""Detached meshes: a small host process owns the ranks so they outlive the kernel.

``%mesh spawn -n N --detach M`` starts this module's ``main()`` in a process of its own
session.  It spawns the ranks (each with a console actor), hosts a ``MeshHost``
actor in itself, and writes what a kernel needs to reconnect (addresses, actor ids, and the
job key) to a 0600 file in Jupyter's runtime directory; the key is never on a command line.
A kernel attaches by reading that file and handing the host a port for the ranks' output
and deaths.  ``%mesh stop M`` (from any attached kernel) ends the ranks and the host.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from ..actor.actor import Actor
from ..actor.endpoint import endpoint
from ..mesh.host_mesh import this_host, this_proc
from ..runtime.envelope import Part, Status
from ..runtime.process import Runtime
from ..runtime.serialize import dumps
from .console import Console

_state: dict = {}  # this host process's mesh, consoles and the event that ends it


def runtime_dir() -> str:
    """Jupyter's runtime directory, created (0700) if this machine never ran Jupyter."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = jupyter_runtime_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def info_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"monarch-mesh-{name}.json")


def log_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"monarch-mesh-{name}.log")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), so a reused pid is not taken for it;
    None if it is not running (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


class MeshHost(Actor):
    """Lives in the host process; the attached kernel's handle on the detached mesh."""

    def __init__(self):
        self.port = None
        self.kernel_pid = None

    @endpoint
    def attach(self, port, kernel_pid: int) -> None:
        rt = Runtime.current()
        if self.port is not None and self.port.address != port.address:
            rt.transport.forget(self.port.address)
        self.port, self.kernel_pid = port, kernel_pid

    def forward(self, message: tuple) -> None:
        """Send an output line or a death to the attached kernel, if it is still there."""
        port, pid = self.port, self.kernel_pid
        if port is None:
            return
        try:
            os.kill(pid, 0)
        except OSError:  # the kernel is gone; wait for the next attach
            self.port = None
            return
        Runtime.current().send_port(port.address, port.port_id, Part(0, Status.OK, dumps(message)))

    @endpoint
    def status(self) -> list[dict]:
        procs = _state["procs"]
        rt = Runtime.current()
        rows = []
        for r in range(len(procs)):
            row = procs._owned.rank_info(r)
            death = rt.dead.get((procs._ref.id, r))
            row["death"] = death.how() if death else None
            rows.append(row)
        return rows

    @endpoint
    def restart(self, ranks: list[int]) -> None:
        _state["procs"]._restart(ranks, [(_state["consoles"], Console, (), {})])

    @endpoint
    def stop(self) -> None:
        _state["procs"].stop().get(timeout=30)
        _state["done"].set()


def main() -> None:
    name, n = sys.argv[1], int(sys.argv[2])
    env = json.loads(sys.stdin.readline() or "{}")
    procs = this_host().spawn_procs(per_host={"ranks": n}, name=name, env=env)
    consoles = procs.spawn("console", Console)
    host = this_proc().spawn("meshhost", MeshHost)
    instance = Runtime.current().actors[host._actor_id].instance
    _state.update(procs=procs, consoles=consoles, done=threading.Event())
    rt = Runtime.current()
    rt.output_sink = lambda mesh, rank, stream, line: instance.forward(("line", mesh, rank, stream, line))
    rt.death_hooks.append(lambda mesh_id, rank, info: instance.forward(("death", mesh_id, rank, info)))
    ref, me = procs._ref, rt.self_mesh
    info = {
        "name": name, "pid": os.getpid(), "start": start_time(os.getpid()), "key": rt.key.hex(),
        "mesh": [ref.id, ref.name, [list(d) for d in ref.dims], list(ref.addresses), ref.owner, list(ref.hosts)],
        "host_mesh": [me.id, me.name, [], list(me.addresses), me.owner, list(me.hosts)],
        "console": consoles._actor_id, "host": host._actor_id,
    }
    path = info_path(name)
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    try:
        _state["done"].wait()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

