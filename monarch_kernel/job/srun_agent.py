"""Agents started as ``srun`` steps (``SlurmJob``), and the batch script that holds their
allocation while any runs: ended together, their start failures read as Slurm's (or, through
a login node, as its ssh connection's), not as ssh's."""

from __future__ import annotations

import threading

from ..runtime.hosting import agent_channel
from .agents import AgentProcess

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


def kill_all(agents: list[AgentProcess]) -> None:
    """End agents together (each waits for its srun to exit)."""
    threads = [threading.Thread(target=a.kill, name=f"monarch-kill-{a.host}", daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class SrunAgent(AgentProcess):
    """An agent started by srun: its start failures read as Slurm's, not ssh's."""

    def __init__(self, *args, job_id: str, login: str | None = None, **kw):
        self.job_id = job_id
        self.login = login  # srun runs there, through ssh
        super().__init__(*args, **kw)

    def _direct_ssh(self) -> bool:
        return False

    def diagnose(self, python: str) -> str:
        text = "\n".join(self.stderr)
        said = self._said()
        where = f"cannot start the agent on {self.host} (srun in Slurm job {self.job_id})"
        if self.login and self.proc.returncode == 255 and "srun:" not in text:
            return f"{where}: the ssh connection to the login node {self.login} failed{said}"
        if agent_channel.NO_ROUTE in text:
            return (f"{where}: the node has no route to this controller's address {self.rt.net_address}: "
                    + ("pass out_of_cluster=True (the default) to reach it through the login node" if self.login
                       else "set MONARCH_KERNEL_BIND to one it reaches, or pass login='user@cluster' to reach it "
                       "through the login node") + said)
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
