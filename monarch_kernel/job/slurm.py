"""``SlurmJob``: the nodes of a Slurm allocation; each runs an agent started as an ``srun`` step.

``sbatch`` makes the allocation with a batch script that only holds it (a loop that ends it
once no agent step has run for ``idle_timeout``: no key, address or command of ours is in
it); each node's agent is an ``srun --overlap`` step in it whose stdin (srun forwards it to
the task) carries the credentials.  The allocation outlives this controller by
``idle_timeout``, so ``dump``/``job_load`` can reattach; ``kill()`` cancels it.  Slurm is
only ever driven through its commands, never a library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from ..actor.host_mesh import HostMesh
from ..runtime import config
from ..runtime.process import Runtime
from .agents import AGENT_MODULE, AgentProcess, controller_address
from .env_sync import HostEnv, sync_hosts
from .job import JobTrait
from .squeue import PLAIN_FORMAT, SqueueJob, find_job, parse_plain

AGENT_STEP = "monarch-agent"  # the srun steps' name, which the hold script looks for
HOLD_SCRIPT = """#!/bin/sh
# monarch-kernel SlurmJob: this only holds the allocation; the agents run as srun steps named
# {step}.  Once none has run for {idle} s (every controller of the job is gone) it ends, and
# the allocation with it.  Without squeue on the node it holds until the time limit.
command -v squeue >/dev/null 2>&1 || exec sleep infinity
idle=0
while sleep 5; do
  steps=$(squeue -h --steps --jobs="$SLURM_JOB_ID" -o %j 2>/dev/null) || {{ idle=0; continue; }}
  if printf '%s\n' "$steps" | grep -qx {step}; then idle=0; else idle=$((idle + 5)); fi
  [ "$idle" -lt {idle} ] || exit 0
done
"""
KEEP_SLURM_VARS = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})  # configuration, not a job's context
COMMAND_TIMEOUT_S = config.seconds("slurm_command_timeout")
CANCEL_TIMEOUT_S = config.seconds("slurm_cancel_timeout")
# Pending reasons that waiting does not cure (and "...PerJobLimit": a QOS or account cap on one job).
NEVER_RUNS = {
    "PartitionNodeLimit": "more nodes than its partition allows or has up (`sinfo -p {partition}` shows them); "
                          "ask for fewer nodes in meshes= or another partition",
    "PartitionTimeLimit": "time_limit is over the partition's MaxTime; ask for less",
    "BadConstraints": "no node matches its constraints (slurm_args, gpus_per_node, cpus_per_task, mem)",
    "InvalidAccount": "the account is not valid for this user; pass account= one `sacctmgr show assoc "
                      "user=$USER` lists",
    "InvalidQOS": "the QOS is not valid for this account; pass another qos=",
    "DependencyNeverSatisfied": "its --dependency can never be met",
}


class SlurmError(RuntimeError):
    """Slurm refused or could not do what the job asked (its own message is included)."""


class SlurmJob(JobTrait):
    """``meshes`` names the host meshes and their node counts; their sum is the allocation::

        job = SlurmJob(meshes={"trainers": 2}, partition="gpu", gpus_per_node=8, time_limit="02:00:00")
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 8})
        job.kill()  # scancel: the allocation is freed

    ``python_exe`` defaults to this controller's own interpreter path (``sys.executable``),
    which is right where the nodes mount the same filesystem (the usual Slurm setup: the
    venv or conda env is the same path everywhere); pass another path, or ``"python3"``,
    when the nodes' interpreter lives elsewhere.  ``exclusive`` (Monarch's default) gives
    the job whole nodes, so its ranks may use every CPU there.  When this controller exits
    without ``kill()``, its agents and ranks end (srun's stdin closes) but the allocation
    stays ``idle_timeout`` seconds more (default 300; None: until ``time_limit``), so that a
    restarted kernel's ``job_load`` finds it; then it ends itself.  ``time_limit`` None: the
    partition's default.  ``job_start_timeout``: seconds to wait for RUNNING
    (then it is cancelled); ``scheduling_delay_s`` says how long the queue took, apart from
    start-up; ``start_timeout``: for the agents to connect (MONARCH_KERNEL_SPAWN_TIMEOUT).
    """

    kind = "slurm"

    def __init__(self, meshes: dict[str, int], python_exe: str | None = None, slurm_args=(),
                 job_name: str = "monarch", time_limit: str | None = "00:30:00", partition: str | None = None,
                 gpus_per_node: int | None = None, cpus_per_task: int | None = None, mem: str | None = None,
                 account: str | None = None, qos: str | None = None, exclusive: bool = True,
                 job_start_timeout: float = 300.0, start_timeout: float | None = None,
                 idle_timeout: float | None = 300.0, sync_env: bool | str = False):
        super().__init__()
        if isinstance(slurm_args, str):
            raise TypeError("slurm_args is a sequence of sbatch arguments, e.g. ('--constraint=h100',), "
                            "not one string")
        if not isinstance(meshes, dict) or not meshes:
            raise ValueError("meshes maps each host mesh's name to its node count, e.g. meshes={'trainers': 2}")
        for name, n in meshes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"mesh names are attributes of job.state(): {name!r} is not an identifier")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"meshes={{{name!r}: {n!r}}}: node counts are positive ints")
        self.meshes = dict(meshes)
        self.python_exe = python_exe or sys.executable
        self.slurm_args = tuple(str(a) for a in slurm_args)
        self.job_name = job_name
        self.time_limit = time_limit
        self.partition = partition
        self.gpus_per_node = gpus_per_node
        self.cpus_per_task = cpus_per_task
        self.mem = mem
        self.account = account
        self.qos = qos
        self.exclusive = exclusive
        self.job_start_timeout = job_start_timeout
        self.start_timeout = start_timeout
        self.idle_timeout = idle_timeout
        self.sync_env = sync_env  # send this environment to the nodes first (a folder: their cache)
        self.env_syncs: dict[str, HostEnv] = {}  # node -> what sync_env did there
        self.job_id: str | None = None  # Slurm's, once submitted (or loaded)
        self.nodes: list[str] = []  # the allocation's nodes, in Slurm's order
        self.allocated_partition = ""  # where Slurm put it (squeue's answer)
        self.scheduling_delay_s: float | None = None  # sbatch to RUNNING; None for a reattached job
        self._agents: dict[str, AgentProcess] = {}  # node -> its agent

    @property
    def node_count(self) -> int:
        return sum(self.meshes.values())

    # ------------------------------------------------------------ commands

    def sbatch_command(self) -> list[str]:
        """The allocation's ``sbatch`` (the batch script itself comes on its stdin)."""
        argv = ["sbatch", "--parsable", f"--nodes={self.node_count}", "--ntasks-per-node=1",
                f"--job-name={self.job_name}", "--output=/dev/null", "--error=/dev/null"]
        for flag, value in (("--time", self.time_limit), ("--partition", self.partition),
                            ("--gpus-per-node", self.gpus_per_node), ("--cpus-per-task", self.cpus_per_task),
                            ("--mem", self.mem), ("--account", self.account), ("--qos", self.qos)):
            if value is not None:
                argv.append(f"{flag}={value}")
        if self.exclusive:
            argv.append("--exclusive")
        return argv + list(self.slurm_args)

    def hold_script(self) -> str:
        """The batch script: it holds the allocation while agents run, ``idle_timeout`` more."""
        if self.idle_timeout is None:
            return "#!/bin/sh\n# monarch-kernel SlurmJob: this only holds the allocation (idle_timeout=None).\n" \
                   "exec sleep infinity\n"
        return HOLD_SCRIPT.format(step=AGENT_STEP, idle=max(5, int(self.idle_timeout)))

    def command(self, node: str) -> list[str]:
        """The ``srun`` that starts ``node``'s agent as a step of the allocation.  --overlap:
        it shares the node with the batch step and with other controllers' agents (a
        reattached job's); without --exact it gets all of the node's CPUs, memory and GRES in
        the allocation, which its ranks inherit.  --export=ALL: the agent gets this
        environment (less what names this process's own Slurm job or bind address)."""
        assert self.job_id is not None
        synced = self.env_syncs.get(node)
        python = synced.python if synced else self.python_exe
        return ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                f"--job-name={AGENT_STEP}", "--input=all", "--kill-on-bad-exit=1", "--export=ALL", "--mpi=none",
                python, "-m", AGENT_MODULE]

    def _remote(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``node`` as a step of the allocation (sync_env's probe and transfer)."""
        return ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                "--input=all", "--export=ALL", "--mpi=none", *argv]

    @staticmethod
    def environment() -> dict[str, str]:
        """What Slurm's commands (and so the agents) get: this environment without the
        variables of a Slurm job this controller may itself run in (they would override
        our flags) and without MONARCH_KERNEL_BIND (this host's address, not the nodes')."""
        return {k: v for k, v in os.environ.items()
                if not (k.startswith("SLURM_") and k not in KEEP_SLURM_VARS) and k != config.env_name("bind_address")}

    def _slurm(self, argv: list[str], input: str | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, input=input, capture_output=True, text=True, env=self.environment(),
                                  timeout=COMMAND_TIMEOUT_S, stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"Slurm's {argv[0]} is not on PATH: run this on a machine of the cluster that can "
                             f"submit jobs (a login node), or add Slurm's bin directory to PATH") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{' '.join(argv[:2])} ...` did not answer in {COMMAND_TIMEOUT_S:g} s: is slurmctld "
                             f"up? (`sinfo` says)") from None

    def query(self) -> SqueueJob | None:
        """What squeue says of this job now; None once it no longer lists it."""
        assert self.job_id is not None
        r = self._slurm(["squeue", "--json", f"--jobs={self.job_id}"])
        if r.returncode == 0:
            try:
                return find_job(json.loads(r.stdout), self.job_id)
            except (ValueError, KeyError, TypeError) as e:
                raise SlurmError(f"cannot read `squeue --json` ({e}); its output began: {r.stdout[:300]!r}") from None
        if "Invalid job id" in r.stderr:
            return None
        # A Slurm built without its JSON plugins: the plain format says as much.
        plain = self._slurm(["squeue", "--noheader", "--states=all", f"--jobs={self.job_id}",
                             f"--format={PLAIN_FORMAT}"])
        if plain.returncode != 0:
            if "Invalid job id" in plain.stderr:
                return None
            raise SlurmError(f"squeue failed (exit {plain.returncode}): {(plain.stderr or r.stderr).strip()}")
        lines = [line for line in plain.stdout.splitlines() if line.strip()]
        return parse_plain(lines[0], self.job_id) if lines else None

    # ------------------------------------------------------------ the allocation

    def _submit(self) -> str:
        argv = self.sbatch_command()
        r = self._slurm(argv, input=self.hold_script())
        if r.returncode != 0:
            said = r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}"
            raise SlurmError(f"sbatch refused the allocation ({' '.join(argv[1:])}): {said}")
        job_id = r.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch --parsable printed {r.stdout.strip()!r}, not a job id")
        return job_id

    def _wait_running(self, timeout: float, cancelled: bool) -> SqueueJob:
        """Until squeue says RUNNING; ``cancelled``: the caller cancels the job if this raises."""
        start = time.monotonic()
        deadline = start + timeout
        interval = 0.1
        last: SqueueJob | None = None
        while True:
            job = self.query()
            if job is not None and job.running and job.nodes:
                return job
            if job is None or job.ended:
                state = f"is {job.state}" + (f" ({job.reason})" if job.reason not in ("", "None") else "") \
                    if job is not None else "is no longer listed by squeue"
                raise SlurmError(f"Slurm job {self.job_id} {state}: its allocation ended before it ran. "
                                 f"`sacct -j {self.job_id}` says why, where accounting is on")
            last = job
            if job.state == "PENDING" and _never_runs(job.reason):
                fix = NEVER_RUNS.get(job.reason, "it is over a per-job limit of its QOS or account")
                fix = fix.format(partition=job.partition or self.partition or "PARTITION")
                raise SlurmError(f"Slurm job {self.job_id} cannot run as asked (pending, reason {job.reason}): {fix}")
            if time.monotonic() > deadline:
                why = f" (reason: {last.reason})" if last.reason not in ("", "None") else ""
                raise TimeoutError(
                    f"Slurm job {self.job_id} was still {last.state}{why} after {timeout:g} s"
                    f"{', so it is cancelled' if cancelled else ''}: "
                    f"ask for fewer nodes or another partition, or raise job_start_timeout "
                    f"(SlurmJob(..., job_start_timeout=...))")
            time.sleep(interval)
            # Polled often at first (scheduling_delay_s is measured by it), then once a second.
            interval = min(0.25 if time.monotonic() - start < 10 else 1.0, interval * 1.5)

    def _cancel(self) -> None:
        """scancel, then wait until squeue no longer lists the job as active."""
        if self.job_id is None:
            return
        r = self._slurm(["scancel", self.job_id])
        if r.returncode != 0 and not any(s in r.stderr for s in ("Invalid job id", "already completing or completed")):
            raise SlurmError(f"scancel {self.job_id} failed: {r.stderr.strip()}")
        deadline = time.monotonic() + CANCEL_TIMEOUT_S
        while True:
            job = self.query()
            if job is None or job.ended:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm job {self.job_id} is still {job.state} {CANCEL_TIMEOUT_S:g} s after "
                                 f"scancel: check its nodes (`squeue -j {self.job_id}`, `sinfo -R`)")
            time.sleep(0.1)

    def _node_address(self, node: str) -> str | None:
        """The address Slurm itself reaches ``node`` at (its NodeAddr), if it knows one."""
        r = self._slurm(["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%o"])
        lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        return lines[0] if r.returncode == 0 and lines and lines[0] != node else None

    def _controller(self, rt: Runtime, node: str) -> str:
        """Our TCP address for the agents: on MONARCH_KERNEL_BIND if set, else on our route
        to the first node, found by its name or, when the name does not resolve here (node
        names often resolve only on the cluster), by the NodeAddr Slurm has for it."""
        if rt.network.net_address is not None or config.bind_address():
            return controller_address(rt, node)
        try:
            return controller_address(rt, node)
        except ConnectionError as e:
            addr = self._node_address(node)
            if addr is None:
                raise ConnectionError(f"{e}, and Slurm gives no other address for it: set MONARCH_KERNEL_BIND to "
                                      f"this machine's address on the network the nodes reach") from None
            return controller_address(rt, addr)

    # ------------------------------------------------------------ JobTrait

    def _create(self) -> None:
        submitted = self.job_id is None
        try:
            if submitted:
                t0 = time.monotonic()
                self.job_id = self._submit()
                job = self._wait_running(self.job_start_timeout, cancelled=True)
                self.scheduling_delay_s = time.monotonic() - t0
            else:
                job = self._reattach()
            if len(job.nodes) < self.node_count:
                raise SlurmError(f"Slurm job {self.job_id} has {len(job.nodes)} nodes ({','.join(job.nodes)}); "
                                 f"these meshes need {self.node_count}")
            self.nodes = list(job.nodes[:self.node_count])
            self.allocated_partition = job.partition
            self._start_agents()
        except BaseException:
            if submitted and self.job_id is not None:  # nobody can use it: free it rather than leave it queued
                try:
                    self._cancel()  # a failed scancel raises its own SlurmError, chained to this error
                finally:
                    self.job_id = None
            raise

    def _reattach(self) -> SqueueJob:
        job = self.query()
        if job is None or job.ended:
            state = f"is {job.state}" if job is not None else "is no longer listed by squeue"
            raise SlurmError(f"the dumped Slurm job {self.job_id} {state}: its allocation is gone (cancelled, "
                             f"timed out or failed). Start a new one: SlurmJob(meshes={self.meshes!r}).state()")
        if not job.running:
            job = self._wait_running(self.job_start_timeout, cancelled=False)
        return job

    def _start_agents(self) -> None:
        rt = Runtime.current()
        controller = self._controller(rt, self.nodes[0])
        env = self.environment()
        if self.sync_env:
            cache = self.sync_env if isinstance(self.sync_env, str) else None
            self.env_syncs = sync_hosts(self.nodes, self._remote, self.python_exe, cache, env=env)
            if not all(e.shared for e in self.env_syncs.values()):
                env.pop("PYTHONPATH", None)  # the synced venv has our folders; these paths are this machine's
        started: dict[str, AgentProcess] = {
            n: _SrunAgent(rt, n, self.command(n), controller, env=env, job_id=self.job_id or "") for n in self.nodes}
        deadline = time.monotonic() + (self.start_timeout or config.spawn_timeout())
        try:
            for agent in started.values():
                agent.wait_up(deadline, self.python_exe)
        except BaseException:
            _kill_all(list(started.values()))
            raise
        self._agents = started

    def _host_meshes(self) -> dict[str, HostMesh]:
        out, i = {}, 0
        for name, n in self.meshes.items():
            out[name] = HostMesh(agents=[self._agents[node].link for node in self.nodes[i:i + n]])
            i += n
        return out

    def _kill(self) -> None:
        _kill_all(list(self._agents.values()))
        self._agents = {}
        self._cancel()
        self.job_id = None
        self.nodes = []

    def _spec(self) -> dict:
        return {"meshes": self.meshes, "python_exe": self.python_exe, "slurm_args": list(self.slurm_args),
                "job_name": self.job_name, "time_limit": self.time_limit, "partition": self.partition,
                "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task, "mem": self.mem,
                "account": self.account, "qos": self.qos, "exclusive": self.exclusive,
                "job_start_timeout": self.job_start_timeout, "idle_timeout": self.idle_timeout,
                "sync_env": self.sync_env,
                "job_id": self.job_id, "nodes": self.nodes}

    @classmethod
    def _from_spec(cls, spec: dict) -> SlurmJob:
        job = cls(meshes=spec["meshes"], python_exe=spec.get("python_exe"), slurm_args=spec.get("slurm_args") or (),
                  job_name=spec.get("job_name", "monarch"), time_limit=spec.get("time_limit"),
                  partition=spec.get("partition"), gpus_per_node=spec.get("gpus_per_node"),
                  cpus_per_task=spec.get("cpus_per_task"), mem=spec.get("mem"), account=spec.get("account"),
                  qos=spec.get("qos"), exclusive=spec.get("exclusive", True),
                  job_start_timeout=spec.get("job_start_timeout", 300.0),
                  idle_timeout=spec.get("idle_timeout", 300.0), sync_env=spec.get("sync_env", False))
        job.job_id = spec.get("job_id")
        return job

    def __repr__(self) -> str:
        where = f" job {self.job_id} on {','.join(self.nodes)}" if self.job_id else ""
        return f"SlurmJob<{self.meshes}{where}>"


def _never_runs(reason: str) -> bool:
    return reason in NEVER_RUNS or reason.endswith("PerJobLimit")


def _kill_all(agents: list[AgentProcess]) -> None:
    """End agents together (each waits for its srun to exit)."""
    threads = [threading.Thread(target=a.kill, name=f"monarch-kill-{a.host}", daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _SrunAgent(AgentProcess):
    """An agent started by srun: its start failures read as Slurm's, not ssh's."""

    def __init__(self, *args, job_id: str, **kw):
        self.job_id = job_id
        super().__init__(*args, **kw)

    def diagnose(self, python: str) -> str:
        text = "\n".join(self.stderr)
        said = self._said()
        where = f"cannot start the agent on {self.host} (srun in Slurm job {self.job_id})"
        if "Invalid job id" in text or "already completing or completed" in text:
            return f"{where}: the allocation is gone (cancelled or timed out){said}"
        if "unrecognized option" in text and "overlap" in text:
            return f"{where}: this Slurm is older than 20.11 (its srun has no --overlap){said}"
        if "No module named" in text and "monarch_kernel" in text:
            return (f"{where}: monarch_kernel is not installed for {python} there; install it where the nodes "
                    f"see it (on a shared filesystem, this controller's environment is theirs), or pass "
                    f"python_exe= an interpreter that has it, or pass sync_env=True (%mesh spawn --sync-env) to "
                    f"send this controller's environment there{said}")
        if "No such file or directory" in text or "command not found" in text or "Permission denied" in text:
            return f"{where}: {python} cannot be run there; pass python_exe= the path of a Python 3 on the nodes{said}"
        return f"{where}: srun exited with status {self.proc.returncode} before the agent connected{said}"
