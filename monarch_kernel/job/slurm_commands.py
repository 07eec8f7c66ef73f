"""Slurm driven through its commands (``sbatch``, ``squeue``, ``scancel``, ``sinfo``), on this
machine or on a login node over one ssh connection: each command run, its answer read, and
its refusals turned into ``SlurmError``s that say what to do.  Never a library of Slurm's, and
nothing of a job's agents or meshes (``slurm.py`` has those).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from ..runtime.hosting import Runtime, config
from .login import LoginNode, shared_login
from .squeue import NEVER_RUNS, PLAIN_FORMAT, SqueueJob, find_job, never_runs, parse_plain

KEEP_SLURM_VARS = frozenset({"SLURM_CONF", "SLURM_CLUSTERS"})  # configuration, not a job's context
COMMAND_TIMEOUT_S = config.seconds("slurm_command_timeout")
CANCEL_TIMEOUT_S = config.seconds("slurm_cancel_timeout")


class SlurmError(RuntimeError):
    """Slurm refused or could not do what the job asked (its own message is included)."""


def slurm_environment() -> dict[str, str]:
    """What Slurm's commands (and so the agents) get: this environment without the
    variables of a Slurm job this controller may itself run in (they would override
    our flags) and without MONARCH_KERNEL_BIND (this host's address, not the nodes')."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("SLURM_") and k not in KEEP_SLURM_VARS) and k != config.env_name("bind_address")}


class SlurmCommands:
    """Slurm's commands for one job: here, or on ``login`` (``"user@cluster"``) through one ssh
    connection, opened at the first command and kept until ``close(job)``."""

    def __init__(self, login: str | None = None, ssh_args: tuple[str, ...] = ()):
        self.login = login
        self.ssh_args = ssh_args
        self._login: LoginNode | None = None  # the ssh connection to ``login``, while the job runs

    @property
    def login_node(self) -> LoginNode | None:
        """The ssh connection to the login node while it is open; None before and after."""
        return self._login

    def open_login(self) -> LoginNode:
        """The ssh connection to the login node (this process's jobs through it share one),
        opened once (before anything is submitted)."""
        if self._login is None:
            assert self.login is not None
            self._login = shared_login(self.login, self.ssh_args, Runtime.current().rundir)
        self._login.open()
        return self._login

    def close(self, job) -> None:
        """``job`` no longer uses the login node's connection (the last job closes it)."""
        login, self._login = self._login, None
        if login is not None:
            login.let_go(job)

    def on(self) -> str:
        """`` on LOGIN`` where the commands run on a login node (for messages)."""
        return f" on {self.login}" if self.login else ""

    def run(self, argv: list[str], input: str | None = None) -> subprocess.CompletedProcess:
        """One Slurm command; a missing command, a silent slurmctld or a lost ssh connection
        is a ``SlurmError``, any other failure is the caller's to read."""
        try:
            if self.login is not None:
                return self.open_login().run(argv, input, COMMAND_TIMEOUT_S)
            return subprocess.run(argv, input=input, capture_output=True, text=True, env=slurm_environment(),
                                  timeout=COMMAND_TIMEOUT_S, stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"Slurm's {argv[0]} is not on PATH{self.on()}: " + (
                "add Slurm's bin directory to PATH in the login node's shell startup file (ssh runs commands in "
                "a non-interactive shell)" if self.login else "run this on a machine of the cluster that can submit "
                "jobs (a login node), or add Slurm's bin directory to PATH, or pass login='user@cluster'")) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"`{' '.join(argv[:2])} ...`{self.on()} did not answer in {COMMAND_TIMEOUT_S:g} s: is "
                             f"slurmctld up? (`sinfo` says)") from None
        except ConnectionError as e:  # the login node's ssh connection
            raise SlurmError(str(e)) from None

    def query(self, job_id: str) -> SqueueJob | None:
        """What squeue says of job ``job_id`` now; None once it no longer lists it."""
        r = self.run(["squeue", "--json", f"--jobs={job_id}"])
        if r.returncode == 0:
            try:
                return find_job(json.loads(r.stdout), job_id)
            except (ValueError, KeyError, TypeError) as e:
                raise SlurmError(f"cannot read `squeue --json` ({e}); its output began: {r.stdout[:300]!r}") from None
        if "Invalid job id" in r.stderr:
            return None
        # A Slurm built without its JSON plugins: the plain format says as much.
        plain = self.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", f"--format={PLAIN_FORMAT}"])
        if plain.returncode != 0:
            if "Invalid job id" in plain.stderr:
                return None
            raise SlurmError(f"squeue{self.on()} failed (exit {plain.returncode}): "
                             f"{(plain.stderr or r.stderr).strip()}")
        lines = [line for line in plain.stdout.splitlines() if line.strip()]
        return parse_plain(lines[0], job_id) if lines else None

    def submit(self, argv: list[str], script: str) -> str:
        """``sbatch --parsable ...`` with the batch ``script`` on its stdin: the new job's id."""
        r = self.run(argv, input=script)
        if r.returncode != 0:
            said = r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}"
            raise SlurmError(f"sbatch{self.on()} refused the allocation ({' '.join(argv[1:])}): {said}")
        job_id = r.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch --parsable printed {r.stdout.strip()!r}, not a job id")
        return job_id

    def wait_running(self, job_id: str, timeout: float, cancelled: bool, partition: str | None) -> SqueueJob:
        """Until squeue says RUNNING; ``cancelled``: the caller cancels the job if this raises;
        ``partition``: the one asked for (named in the fix for a job that can never run)."""
        start = time.monotonic()
        deadline = start + timeout
        interval = 0.1
        last: SqueueJob | None = None
        while True:
            job = self.query(job_id)
            if job is not None and job.running and job.nodes:
                return job
            if job is None or job.ended:
                state = f"is {job.state}" + (f" ({job.reason})" if job.reason not in ("", "None") else "") \
                    if job is not None else "is no longer listed by squeue"
                raise SlurmError(f"Slurm job {job_id} {state}: its allocation ended before it ran. "
                                 f"`sacct -j {job_id}` says why, where accounting is on")
            last = job
            if job.state == "PENDING" and never_runs(job.reason):
                fix = NEVER_RUNS.get(job.reason, "it is over a per-job limit of its QOS or account")
                fix = fix.format(partition=job.partition or partition or "PARTITION")
                raise SlurmError(f"Slurm job {job_id} cannot run as asked (pending, reason {job.reason}): {fix}")
            if time.monotonic() > deadline:
                why = f" (reason: {last.reason})" if last.reason not in ("", "None") else ""
                raise TimeoutError(
                    f"Slurm job {job_id} was still {last.state}{why} after {timeout:g} s"
                    f"{', so it is cancelled' if cancelled else ''}: "
                    f"ask for fewer nodes or another partition, or raise job_start_timeout "
                    f"(SlurmJob(..., job_start_timeout=...))")
            time.sleep(interval)
            # Polled often at first (scheduling_delay_s is measured by it), then once a second.
            interval = min(0.25 if time.monotonic() - start < 10 else 1.0, interval * 1.5)

    def cancel(self, job_id: str) -> None:
        """scancel, then wait until squeue no longer lists the job as active."""
        r = self.run(["scancel", job_id])
        if r.returncode != 0 and not any(s in r.stderr for s in ("Invalid job id", "already completing or completed")):
            raise SlurmError(f"scancel {job_id}{self.on()} failed: {r.stderr.strip()}")
        deadline = time.monotonic() + CANCEL_TIMEOUT_S
        while True:
            job = self.query(job_id)
            if job is None or job.ended:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"Slurm job {job_id} is still {job.state} {CANCEL_TIMEOUT_S:g} s after "
                                 f"scancel: check its nodes (`squeue -j {job_id}`, `sinfo -R`)")
            time.sleep(0.1)

    def node_address(self, node: str) -> str | None:
        """The address Slurm itself reaches ``node`` at (its NodeAddr), if it knows one."""
        r = self.run(["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%o"])
        lines = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        return lines[0] if r.returncode == 0 and lines and lines[0] != node else None
