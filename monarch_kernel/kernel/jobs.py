"""The jobs this kernel holds: those it started from magics (``%mesh spawn --job ssh|slurm``,
``--attach``) and those a cell made with the API (``SSHJob(...).state()``, adopted after the
cell): their names, which meshes run on each, and ending them (``%mesh kill-job``).

A job outlives its meshes: stopping the last mesh of a job leaves its hosts (and a Slurm
allocation) for the next ``%mesh spawn --job NAME``; only ``%mesh kill-job`` frees them.
"""

from __future__ import annotations

import logging
import shlex
import sys

from IPython.core.error import UsageError

from ..job import AttachJob, JobTrait, SlurmJob, SSHJob, running_jobs
from ..runtime import Runtime

log = logging.getLogger(__name__)

class KernelJobs:
    def __init__(self) -> None:
        self.jobs: dict[str, JobTrait] = {}  # job name -> job
        self.meshes: dict[str, str] = {}  # mesh name -> the job it runs on
        self._count: dict[str, int] = {}
        self._adopted: set[str] = set()  # names of jobs a cell made with the API

    def _name(self, kind: str) -> str:
        n = self._count.get(kind, 0)
        self._count[kind] = n + 1
        return f"{kind}{n}"

    @staticmethod
    def check_attach(a) -> None:
        """``--attach`` and ``--key-file`` go together, and with no other way to find hosts."""
        if a.key_file and not a.attach:
            raise UsageError("--key-file goes with --attach: type  %mesh spawn --attach tcp://node1:29500 "
                             "--key-file ~/.mk-key -n 2")
        if not a.attach:
            return
        if a.job or a.hosts or a.nodes or a.ssh_args or a.python:
            raise UsageError("--attach starts the ranks on running workers; it takes no --job, --hosts, --nodes, "
                             "--ssh-args or --python (the workers' own interpreter runs them)")
        if a.detach:
            raise UsageError("--detach with --attach is not supported yet: attach without --detach (the workers "
                             "outlive this kernel anyway, and end its ranks when it ends)")
        if not a.key_file:
            raise UsageError("--attach needs the workers' key: type  %mesh spawn --attach tcp://node1:29500 "
                             "--key-file ~/.mk-key -n 2")

    def open(self, a) -> tuple[str, JobTrait]:
        """The job ``%mesh spawn --job ...`` names: an existing one, or a new ssh/slurm job
        (or, with ``--attach``, a new attached one)."""
        if a.out_of_cluster and a.job != "ssh" and not (a.job == "slurm" and a.login):
            raise UsageError(f"--out-of-cluster is for a new ssh job (--job ssh --hosts h1,h2) or a slurm job "
                             f"through a login node (--job slurm --login me@cluster), not --job {a.job}"
                             + ("" if a.job == "slurm" else ": a running job keeps how its hosts reach this kernel"))
        if a.ssh_args and a.job == "slurm" and not a.login:
            raise UsageError("--ssh-args with --job slurm are for its login node: add  --login me@cluster")
        if a.login and a.job != "slurm":
            raise UsageError(f"--login is a Slurm cluster's login node: type  --job slurm --nodes N --login {a.login}")
        if a.job in self.jobs:
            if not self.jobs[a.job].active:
                raise UsageError(f"job {a.job!r} was killed; start a new one with  --job ssh  or  --job slurm")
            return a.job, self.jobs[a.job]
        job = self.make(a)
        name = self._name(a.job or "attach")
        job.apply()  # starts the agents (and waits for Slurm's allocation) before anything is kept
        self.jobs[name] = job
        return name, job

    def make(self, a) -> JobTrait:
        """A new, not yet started, job from ``%mesh spawn --job ssh|slurm`` arguments."""
        if a.job in self.jobs:
            raise UsageError(f"--detach starts a job of its own for the detached mesh: type  --job ssh --hosts ... "
                             f"or  --job slurm --nodes N,  not a running job's name ({a.job})")
        job: JobTrait
        if a.attach:
            try:
                job = AttachJob(a.attach, a.key_file)
            except (ValueError, OSError) as e:  # a malformed address; a key file missing or readable by others
                raise UsageError(f"--attach {a.attach} --key-file {a.key_file}: {e}") from None
        elif a.job == "ssh":
            if not a.hosts:
                raise UsageError("--job ssh needs its hosts: type  %mesh spawn --job ssh --hosts h1,h2 -n 2")
            ssh = SSHJob(python_exe=a.python or ("python3" if a.sync_env else sys.executable),
                         ssh_args=_ssh_args(a), sync_env=a.sync_env, out_of_cluster=_out_of_cluster(a))
            job = ssh.add_mesh("hosts", [h for h in a.hosts.split(",") if h])
        elif a.job == "slurm":
            job = SlurmJob(meshes={"hosts": a.nodes or 1}, partition=a.partition, time_limit=a.time,
                           account=a.account, python_exe=a.python or ("python3" if a.sync_env else sys.executable),
                           sync_env=a.sync_env, login=a.login, ssh_args=_ssh_args(a), out_of_cluster=_out_of_cluster(a))
        else:
            known = ", ".join(self.jobs) or "none yet"
            raise UsageError(f"--job {a.job!r}: type  --job ssh --hosts h1,h2  or  --job slurm --nodes N,  "
                             f"or the name of a running job ({known}; see %mesh jobs)")
        return job

    def adopt(self) -> list[str]:
        """The running jobs a cell made with the API, named here (``cell-ssh0``: never a name
        ``%mesh spawn --job`` gives its own) so that ``%mesh jobs``, ``%mesh kill-job`` and
        ``monarch-kernel ls``/``kill-job`` reach them too; their names.  One the API killed since
        is dropped (as ``%mesh kill-job`` drops its own)."""
        for name in [n for n in self._adopted if not self.jobs[n].active]:
            del self.jobs[name]
            self._adopted.discard(name)
        held = {id(job) for job in self.jobs.values()}
        named = []
        for job in running_jobs():
            if id(job) not in held:
                name = self._name(f"cell-{job.kind or 'job'}")
                self.jobs[name] = job
                self._adopted.add(name)
                named.append(name)
        return named

    @staticmethod
    def hosts(job: JobTrait) -> list[str]:
        return [h for _n, hm in job.state() for h in hm.host_names] if job.active else []

    def meshes_of(self, name: str) -> list[str]:
        """The meshes on job ``name``: spawned with ``--job``, or with the API on its hosts."""
        meshes = [m for m, j in self.meshes.items() if j == name]
        job = self.jobs.get(name)
        hosts = set(self.hosts(job)) if job is not None else set()
        rt = Runtime.existing()
        for om in rt.owned_meshes() if rt is not None and hosts else ():
            ref = om.ref
            if not om.stopping and ref.name not in self.meshes and set(ref.hosts) <= hosts:
                meshes.append(ref.name)
        return meshes

    def host_mesh(self, job: JobTrait):
        return next(iter(job.state()))[1]

    def listing(self) -> list[str]:
        self.adopt()
        if not self.jobs:
            return ["no jobs; start one with  procs = %mesh spawn --job ssh --hosts h1,h2 -n 2"]
        out = []
        for name, job in self.jobs.items():
            meshes = self.meshes_of(name)
            hosts = ", ".join(self.hosts(job))
            extra = f", Slurm job {job.job_id}" if isinstance(job, SlurmJob) and job.job_id else ""
            state = "running" if job.active else "killed"
            out.append(f"{name} ({job.kind}{extra}): {state}; hosts: {hosts or '-'}; "
                       f"meshes: {', '.join(meshes) or 'none'}")
        return out

    def kill(self, name: str | None) -> tuple[str, list[str]]:
        """Kill job ``name`` (the only one, if None); returns its name and its meshes."""
        self.adopt()
        if name is None:
            if len(self.jobs) != 1:
                raise UsageError(f"which job? type  %mesh kill-job NAME  ({', '.join(self.jobs) or 'no jobs'})")
            name = next(iter(self.jobs))
        job = self.jobs.get(name)
        if job is None:
            raise UsageError(f"no job {name!r}; %mesh jobs lists them")
        meshes = self.meshes_of(name)
        job.kill()
        for m in meshes:
            self.meshes.pop(m, None)
        del self.jobs[name]
        self._adopted.discard(name)
        return name, meshes

    def close(self) -> None:
        """The kernel is ending: its jobs end with it (agents, ranks, and allocations);
        attached workers end its ranks and wait for the next controller."""
        for job in list(self.jobs.values()):
            try:
                job.release()
            except Exception as e:  # noqa: BLE001  (one job's failure must not keep the others)
                log.error("monarch_kernel: ending a job failed: %s", e)
        self.jobs.clear()
        self._adopted.clear()


def _ssh_args(a) -> list[str]:
    """``--ssh-args``, split as a shell would (IPython's argument splitter keeps the quotes)."""
    quoted = a.ssh_args or ""
    if len(quoted) > 1 and quoted[0] == quoted[-1] and quoted[0] in "'\"":
        quoted = quoted[1:-1]
    try:
        return shlex.split(quoted)
    except ValueError as e:
        raise UsageError(f"--ssh-args {a.ssh_args!r}: {e}") from None


def _out_of_cluster(a) -> bool | None:
    return {"yes": True, "no": False}.get(a.out_of_cluster or "auto")
