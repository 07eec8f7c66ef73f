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
import time

from ..actor.host_mesh import HostMesh
from ..runtime.hosting import Runtime, config, counted
from ..runtime.hosting import hosts as host_names
from .agents import AGENT_MODULE, AgentProcess, controller_address
from .env_sync import HostEnv, sync_hosts
from .job import JobTrait
from .login import LoginNode, agent_settings, shared_login
from .squeue import NEVER_RUNS, PLAIN_FORMAT, SqueueJob, find_job, never_runs, parse_plain
from .srun_agent import AGENT_STEP, HOLD_SCRIPT, SrunAgent, kill_all
from .ssh_config import route_host

KEEP_SLURM_VARS = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})  # configuration, not a job's context
COMMAND_TIMEOUT_S = config.seconds("slurm_command_timeout")
CANCEL_TIMEOUT_S = config.seconds("slurm_cancel_timeout")


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

    ``login="user@cluster"`` (a laptop outside the cluster): Slurm's commands run on that login
    node over one ssh connection (``ssh_args``, ``~/.ssh/config`` and ``-J`` as for ssh), and the
    mesh's connections pass through it (``login.py``); this controller opens no network port.
    ``out_of_cluster=False``: the nodes can connect to it directly (only the commands use ssh).
    """

    kind = "slurm"

    def __init__(self, meshes: dict[str, int], python_exe: str | None = None, slurm_args=(),
                 job_name: str = "monarch", time_limit: str | None = "00:30:00", partition: str | None = None,
                 gpus_per_node: int | None = None, cpus_per_task: int | None = None, mem: str | None = None,
                 account: str | None = None, qos: str | None = None, exclusive: bool = True,
                 job_start_timeout: float = 300.0, start_timeout: float | None = None,
                 idle_timeout: float | None = 300.0, sync_env: bool | str = False, login: str | None = None,
                 ssh_args=(), out_of_cluster: bool | None = None):
        super().__init__()
        if isinstance(ssh_args, str):
            raise TypeError("ssh_args is a sequence of ssh's arguments for login=, e.g. ('-i', '~/.ssh/id_ed25519'), "
                            "not one string")
        if login is not None and (not isinstance(login, str) or not login or login.startswith("-")):
            raise ValueError(f"login is the login node as ssh reaches it, e.g. login='me@cluster', not {login!r:.80}")
        if login is not None:
            host_names.check_name(login.rpartition("@")[2], "login=", "login='me@cluster'")
        if out_of_cluster is not None and not isinstance(out_of_cluster, bool):
            raise TypeError(f"out_of_cluster is True, False or None, not {out_of_cluster!r}")
        if out_of_cluster and login is None:
            raise ValueError("out_of_cluster=True reaches the nodes through a login node: pass login='user@cluster'")
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
        self.login = login
        self.ssh_args = tuple(str(a) for a in ssh_args)
        self.out_of_cluster = out_of_cluster
        self._login: LoginNode | None = None  # the ssh connection to ``login``, while the job runs
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
        srun = ["srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                "--input=all", "--export=ALL", "--mpi=none", *argv]
        return self._login.command(srun) if self._login else srun

    def _login_node(self) -> LoginNode:
        """The ssh connection to the login node, opened once (before anything is submitted)."""
        if self._login is None:
            assert self.login is not None
            self._login = shared_login(self.login, self.ssh_args, Runtime.current().rundir)
        self._login.open()
        return self._login

    @staticmethod
    def environment() -> dict[str, str]:
        """What Slurm's commands (and so the agents) get: this environment without the
        variables of a Slurm job this controller may itself run in (they would override
        our flags) and without MONARCH_KERNEL_BIND (this host's address, not the nodes')."""
        return {k: v for k, v in os.environ.items()
                if not (k.startswith("SLURM_") and k not in KEEP_SLURM_VARS) and k != config.env_name("bind_address")}

    def _slurm(self, argv: list[str], input: str | None = None) -> subprocess.CompletedProcess:
        try:
            if self.login is not None:
                return self._login_node().run(argv, input, COMMAND_TIMEOUT_S)
            return subprocess.run(argv, input=input, capture_output=True, text=True, env=self.environment(),
                                  timeout=COMMAND_TIMEOUT_S, stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"Slurm's {argv[0]} is not on PATH{self._on()}: " + (
                "add Slurm's bin directory to PATH in the login node's shell startup file (ssh runs commands in "
                "a non-interactive shell)" if self.login else "run this on a machine of the cluster that can submit "
                "jobs (a login node), or add Slurm's bin directory to PATH, or pass login='user@cluster'")) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{' '.join(argv[:2])} ...`{self._on()} did not answer in {COMMAND_TIMEOUT_S:g} s: is "
                             f"slurmctld up? (`sinfo` says)") from None
        except ConnectionError as e:  # the login node's ssh connection
            raise SlurmError(str(e)) from None

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
            raise SlurmError(f"squeue{self._on()} failed (exit {plain.returncode}): "
                             f"{(plain.stderr or r.stderr).strip()}")
        lines = [line for line in plain.stdout.splitlines() if line.strip()]
        return parse_plain(lines[0], self.job_id) if lines else None

    # ------------------------------------------------------------ the allocation

    def _submit(self) -> str:
        argv = self.sbatch_command()
        r = self._slurm(argv, input=self.hold_script())
        if r.returncode != 0:
            said = r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}"
            raise SlurmError(f"sbatch{self._on()} refused the allocation ({' '.join(argv[1:])}): {said}")
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
            if job.state == "PENDING" and never_runs(job.reason):
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
            raise SlurmError(f"scancel {self.job_id}{self._on()} failed: {r.stderr.strip()}")
        deadline = time.monotonic() + CANCEL_TIMEOUT_S
        while True:
            job = self.query()
            if job is None or job.ended:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm job {self.job_id} is still {job.state} {CANCEL_TIMEOUT_S:g} s after "
                                 f"scancel: check its nodes (`squeue -j {self.job_id}`, `sinfo -R`)")
            time.sleep(0.1)

    def _on(self) -> str:
        return f" on {self.login}" if self.login else ""

    def _node_address(self, node: str) -> str | None:
        """The address Slurm itself reaches ``node`` at (its NodeAddr), if it knows one."""
        r = self._slurm(["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%o"])
        lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        return lines[0] if r.returncode == 0 and lines and lines[0] != node else None

    def _controller(self, rt: Runtime, node: str) -> str:
        """Our TCP address for the agents: on MONARCH_KERNEL_BIND if set, else on our route
        to the first node, found by its name or, when the name does not resolve here (node
        names often resolve only on the cluster), by the NodeAddr Slurm has for it."""
        if self.login is not None and not config.bind_address():  # in the cluster's network, beside its login node
            return controller_address(rt, route_host(self.login, self.ssh_args))
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
        if self.login is not None:
            self._login_node()  # a bad login fails here, before anything is submitted
        try:
            if submitted:
                t0 = time.monotonic()
                self.job_id = self._submit()
                job = self._wait_running(self.job_start_timeout, cancelled=True)
                self.scheduling_delay_s = time.monotonic() - t0
            else:
                job = self._reattach()
            if len(job.nodes) < self.node_count:
                raise SlurmError(f"Slurm job {self.job_id} has {counted(len(job.nodes), 'node')} "
                                 f"({','.join(job.nodes)}); "
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
            self._close_login()
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
        if self.login is not None:
            return self._start_agents_on_login(rt)
        controller = self._controller(rt, self.nodes[0])
        env = self.environment()
        self._sync(env)
        self._wait_agents({n: SrunAgent(rt, n, self.command(n), controller, env=env, job_id=self.job_id or "")
                           for n in self.nodes})

    def _start_agents_on_login(self, rt: Runtime) -> None:
        """Agents as srun steps started on the login node, their stdin through its ssh connection;
        out of cluster, they and their ranks reach this controller through its relay."""
        login = self._login_node()
        links = {n: rt.add_host(n) for n in self.nodes}
        env = agent_settings()
        try:
            if self.out_of_cluster is not False:
                target = self._node_address(self.nodes[0]) or self.nodes[0]
                env[config.env_name("controller_via")] = login.reach(rt, target, links, self)
            first = self.nodes[0]
            controller = rt.net_address if self.out_of_cluster is not False else self._controller(rt, first)
            self._sync(None)
        except BaseException:
            for link in links.values():
                rt.forget_host(link, "its agent was never started")
            raise
        paths = {n: {"PYTHONPATH": e.pythonpath} for n, e in self.env_syncs.items() if e.pythonpath}  # shared files
        self._wait_agents({n: SrunAgent(rt, n, login.command(self.command(n), {**env, **paths.get(n, {})}),
                                         controller, job_id=self.job_id or "", link=links[n], login=self.login)
                           for n in self.nodes})

    def _sync(self, env: dict | None) -> None:
        """sync_env: this environment to the nodes first (``env``: what srun runs with here)."""
        if self.sync_env:
            cache = self.sync_env if isinstance(self.sync_env, str) else None
            self.env_syncs = sync_hosts(self.nodes, self._remote, self.python_exe, cache, env=env)
            if env is not None and not all(e.shared for e in self.env_syncs.values()):
                env.pop("PYTHONPATH", None)  # the synced venv has our folders; these paths are this machine's

    def _wait_agents(self, started: dict[str, AgentProcess]) -> None:
        deadline = time.monotonic() + (self.start_timeout or config.spawn_timeout())
        try:
            for agent in started.values():
                agent.wait_up(deadline, self.python_exe)
        except BaseException:
            kill_all(list(started.values()))
            raise
        self._agents = started

    def _host_meshes(self) -> dict[str, HostMesh]:
        out, i = {}, 0
        for name, n in self.meshes.items():
            out[name] = HostMesh(agents=[self._agents[node].link for node in self.nodes[i:i + n]])
            i += n
        return out

    def _kill(self) -> None:
        kill_all(list(self._agents.values()))
        self._agents = {}
        try:
            self._cancel()
        finally:
            self._close_login()
        self.job_id = None
        self.nodes = []

    def _close_login(self) -> None:
        login, self._login = self._login, None
        if login is not None:
            login.let_go(self)

    def _spec(self) -> dict:
        return {"meshes": self.meshes, "python_exe": self.python_exe, "slurm_args": list(self.slurm_args),
                "job_name": self.job_name, "time_limit": self.time_limit, "partition": self.partition,
                "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task, "mem": self.mem,
                "account": self.account, "qos": self.qos, "exclusive": self.exclusive,
                "job_start_timeout": self.job_start_timeout, "idle_timeout": self.idle_timeout,
                "sync_env": self.sync_env, "login": self.login, "ssh_args": list(self.ssh_args),
                "out_of_cluster": self.out_of_cluster,
                "job_id": self.job_id, "nodes": self.nodes}

    @classmethod
    def _from_spec(cls, spec: dict) -> SlurmJob:
        job = cls(meshes=spec["meshes"], python_exe=spec.get("python_exe"), slurm_args=spec.get("slurm_args") or (),
                  job_name=spec.get("job_name", "monarch"), time_limit=spec.get("time_limit"),
                  partition=spec.get("partition"), gpus_per_node=spec.get("gpus_per_node"),
                  cpus_per_task=spec.get("cpus_per_task"), mem=spec.get("mem"), account=spec.get("account"),
                  qos=spec.get("qos"), exclusive=spec.get("exclusive", True),
                  job_start_timeout=spec.get("job_start_timeout", 300.0),
                  idle_timeout=spec.get("idle_timeout", 300.0), sync_env=spec.get("sync_env", False),
                  login=spec.get("login"), ssh_args=spec.get("ssh_args") or (),
                  out_of_cluster=spec.get("out_of_cluster"))
        job.job_id = spec.get("job_id")
        return job

    def __repr__(self) -> str:
        where = f" job {self.job_id} on {','.join(self.nodes)}" if self.job_id else ""
        return f"SlurmJob<{self.meshes}{where}>"
