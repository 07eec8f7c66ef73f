"""``SlurmJob``: the nodes of a Slurm allocation; each runs an agent started as an ``srun`` step.

``sbatch`` makes the allocation with a batch script that only holds it (a loop that ends it
once no agent step has run for ``idle_timeout``: no key, address or command of ours is in
it); each node's agent is an ``srun --overlap`` step in it whose stdin (srun forwards it to
the task) carries the credentials.  The allocation outlives this controller by
``idle_timeout``, so ``dump``/``job_load`` can reattach; ``kill()`` cancels it.  Slurm is
only ever driven through its commands (``slurm_commands.py``), never a library.
"""

from __future__ import annotations

import sys
import time

from ..actor.host_mesh import HostMesh
from ..runtime.hosting import Runtime, config, counted
from ..runtime.hosting import hosts as host_names
from .agents import AGENT_MODULE, AgentProcess, controller_address
from .env_sync import HostEnv, sync_hosts
from .job import JobTrait
from .login import agent_settings
from .slurm_commands import SlurmCommands, SlurmError, slurm_environment
from .squeue import SqueueJob
from .srun_agent import AGENT_STEP, HOLD_SCRIPT, SrunAgent, kill_all
from .ssh_config import route_host


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
        self._slurm = SlurmCommands(login, self.ssh_args)  # sbatch, squeue, scancel, sinfo: here or on login
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
        login = self._slurm.login_node
        return login.command(srun) if login else srun

    @staticmethod
    def environment() -> dict[str, str]:
        """What Slurm's commands (and so the agents) get (``slurm_environment``)."""
        return slurm_environment()

    def query(self) -> SqueueJob | None:
        """What squeue says of this job now; None once it no longer lists it."""
        assert self.job_id is not None
        return self._slurm.query(self.job_id)

    # ------------------------------------------------------------ the allocation

    def _cancel(self) -> None:
        if self.job_id is not None:
            self._slurm.cancel(self.job_id)

    def _controller(self, rt: Runtime, node: str) -> str:
        """Our TCP address for the agents: on MONARCH_KERNEL_BIND if set, else on our route
        to the first node, found by its name or, when the name does not resolve here (node
        names often resolve only on the cluster), by the NodeAddr Slurm has for it."""
        if self.login is not None and not config.bind_address():  # in the cluster's network, beside its login node
            return controller_address(rt, route_host(self.login, self.ssh_args))
        try:
            return controller_address(rt, node)
        except ConnectionError as e:
            addr = self._slurm.node_address(node)
            if addr is None:
                raise ConnectionError(f"{e}, and Slurm gives no other address for it: set MONARCH_KERNEL_BIND to "
                                      f"this machine's address on the network the nodes reach") from None
            return controller_address(rt, addr)

    # ------------------------------------------------------------ JobTrait

    def _create(self) -> None:
        submitted = self.job_id is None
        if self.login is not None:
            self._slurm.open_login()  # a bad login fails here, before anything is submitted
        try:
            if submitted:
                t0 = time.monotonic()
                self.job_id = self._slurm.submit(self.sbatch_command(), self.hold_script())
                job = self._slurm.wait_running(self.job_id, self.job_start_timeout, True, self.partition)
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
            self._slurm.close(self)
            raise

    def _reattach(self) -> SqueueJob:
        assert self.job_id is not None
        job = self._slurm.query(self.job_id)
        if job is None or job.ended:
            state = f"is {job.state}" if job is not None else "is no longer listed by squeue"
            raise SlurmError(f"the dumped Slurm job {self.job_id} {state}: its allocation is gone (cancelled, "
                             f"timed out or failed). Start a new one: SlurmJob(meshes={self.meshes!r}).state()")
        if not job.running:
            job = self._slurm.wait_running(self.job_id, self.job_start_timeout, False, self.partition)
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
        login = self._slurm.open_login()
        links = {n: rt.add_host(n) for n in self.nodes}
        env = agent_settings()
        try:
            if self.out_of_cluster is not False:
                target = self._slurm.node_address(self.nodes[0]) or self.nodes[0]
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
            self._slurm.close(self)
        self.job_id = None
        self.nodes = []

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
