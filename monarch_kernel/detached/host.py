"""The host process of a detached mesh: it owns the ranks so they outlive the kernel.

``%mesh spawn -n N --detach M`` starts ``main()`` in a process of its own session.  It
spawns the ranks (each with a console actor; on a job's hosts with ``--job``, a job this
process starts and owns), hosts a ``MeshHost`` actor in itself and writes its record
(``records.py``); the keys are never on a command line.  A kernel attaches
by reading the record and handing the host a port for the ranks' output and deaths.
``%mesh stop M`` (from any attached kernel) ends the ranks and the host.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from ..actor.actor import Actor
from ..actor.endpoint import endpoint
from ..actor.host_mesh import this_host, this_proc
from ..console.console import Console
from ..runtime import Runtime
from . import records


class MeshHost(Actor):
    """Lives in the host process; the attached kernel's handle on the detached mesh."""

    def __init__(self):
        self.port = None
        self.kernel_pid = None
        self.holder: dict | None = None  # the kernel attached last: its ids, pid and start time
        self.procs = None  # set by main(): the mesh, its consoles, and what ends the host
        self.consoles = None
        self.job = None  # the job whose hosts the ranks run on, if any
        self.done = threading.Event()

    @endpoint
    def attach(self, port, kernel_pid: int, kernel: dict | None = None) -> dict | None:
        """The kernel of process ``kernel_pid`` gets the output and deaths from now on;
        ``kernel``: its Jupyter ids (``kernel_id``, ``notebook``).  Returns the kernel that
        had the mesh before (those ids, ``pid``, and whether it still ``running``), or None."""
        if self.port is not None and self.port.address != port.address:
            rt = Runtime.current()
            rt.forget_peer(self.port.address)
        before = self.holder
        if before is not None:
            now = records.start_time(before["pid"])
            before = {**before, "running": now is not None and now == before["start"]}
        self.port, self.kernel_pid = port, kernel_pid
        self.holder = {**(kernel or {}), "pid": kernel_pid, "start": records.start_time(kernel_pid)}
        return before

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
        port.send(message)

    @endpoint
    def status(self) -> list[dict]:
        """``ProcMesh.rank_states()`` of the mesh, as its owner sees it."""
        return self.procs.rank_states()

    @endpoint
    def usage(self) -> tuple[dict, dict]:
        """``observe.metrics.usage()`` of the mesh (CPU ticks, memory and GPU per rank, and the
        ranks' pids): the host owns the ranks, so only it can sample them (``monarch-kernel top``)."""
        from ..observe.metrics import usage

        return usage(self.procs)

    @endpoint
    def restart(self, ranks: list[int] | None = None):
        """``ProcMesh.restart`` of the mesh, each restarted rank with a fresh console."""
        return self.procs.restart(ranks, [(self.consoles, Console, (), {})])

    @endpoint
    def answered(self) -> None:
        """Nothing: a call behind ``stop_mesh`` on this worker returns once its answer left."""

    @endpoint
    def stop_mesh(self) -> None:
        # Not ``stop``: ActorMesh.stop() (stopping the host actor itself) would hide it.
        self.procs.stop().get(timeout=30)
        if self.job is not None:
            self.job.kill()  # its agents, and a Slurm allocation
        self.done.set()


def main() -> None:
    name, n = sys.argv[1], int(sys.argv[2])
    given = json.loads(sys.stdin.readline() or "{}")
    env, spec = (given.get("env", {}), given.get("job")) if "env" in given else (given, None)
    job = None
    if spec is not None:  # the ranks run on a job's hosts, which this process starts and owns
        from ..job import job_from_spec

        job = job_from_spec(spec)
        hosts = next(iter(job.state()))[1]
    else:
        hosts = this_host()
    procs = hosts.spawn_procs(per_host={"ranks": n}, name=name, env=env, check_limits=given.get("check_limits"))
    consoles = procs.spawn("console", Console)
    host = this_proc().spawn("meshhost", MeshHost)
    consoles.initialized().get(timeout=60)
    host.initialized().get(timeout=60)
    rt = Runtime.current()
    instance = rt.actor_instance(host.actor_id)
    instance.procs, instance.consoles, instance.job = procs, consoles, job
    rt.hooks.output.install(lambda mesh, rank, stream, line: instance.forward(("line", mesh, rank, stream, line)))
    rt.hooks.death.install(lambda mesh_id, rank, info: instance.forward(("death", mesh_id, rank, info)))
    from ..history import current_run  # loaded once the ranks exist (their spawn loaded the history)

    keys = rt.curve_keys
    curve = [k.decode() for k in keys.to_wire()] if job is not None and keys is not None else None
    record = records.Record(name, os.getpid(), records.start_time(os.getpid()), rt.key.hex(),
                            procs.ref.to_wire(), rt.self_mesh.to_wire(), consoles.actor_id, host.actor_id,
                            curve, job.spec() if job is not None else None,
                            (job.routes() if job is not None else None) or None,  # SSHJob's, out of cluster
                            current_run(procs))
    record.write()
    try:
        instance.done.wait()
        # ``stop_mesh`` sets ``done`` before its answer leaves: the process ends only once it
        # has (else its caller could wait for an answer that went down with the process).
        try:
            host.answered.call_one().get(timeout=10)
        except Exception:  # noqa: BLE001  (ending anyway)
            pass
    finally:
        try:
            os.unlink(records.info_path(name))
        except FileNotFoundError:
            pass
