"""W10 (restart): a rank of a 2-rank mesh whose restart policy is "on-failure" is SIGKILLed
after its ranks imported torch; from the SIGKILL to the replacement answering its first call
(a torch op), with the standby template warm (issue 44 point 2's target: under 1 s), and once
cold (killed before the standby imported torch).  Beside
the same run's W2 floor (a raw pyzmq round trip) and a cold ``import torch`` in a fresh
interpreter (what a cold replacement pays on top).  W10restart_hosts: the same for a rank on
another host (network namespaces with their own sshd, as the tests build them), replaced by
its host's agent from the agent's own standby; needs root."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ._util import ROOT, log
from .floors import pyzmq_rtt

KILLS = 5


def w10_restart() -> dict:
    from monarch_kernel import this_host

    floor = pyzmq_rtt()[0]
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    cold_import = time.monotonic() - t
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure", max_restarts=-1)
    try:
        out = _kills("W10restart", procs, {"r": 1})
    finally:
        procs.stop().get(timeout=30)
    return {**out, "W10restart_cold_import_torch_s": round(cold_import, 3), "W10restart_floor_pyzmq_rtt_us": floor}


def w10_restart_hosts() -> dict:
    if os.geteuid() != 0:
        return {"W10restart_hosts_skipped": "needs root: network namespaces and sshd simulate the hosts"}
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support import cluster  # the tests' simulated hosts

    from monarch_kernel.job import SSHJob

    floor = pyzmq_rtt()[0]
    with cluster.ssh_network() as net, tempfile.TemporaryDirectory() as tmp:
        job = SSHJob(python_exe=cluster.checkout_python(tmp), ssh_args=net.ssh_args)
        job.add_mesh("w", net.hosts)
        try:
            procs = job.state().w.spawn_procs(per_host={"gpus": 1}, restart="on-failure", max_restarts=-1)
            out = _kills("W10restart_hosts", procs, {"hosts": 1})
        finally:
            job.kill()
    return {**out, "W10restart_hosts_floor_pyzmq_rtt_us": floor}


def _kills(name: str, procs, where: dict) -> dict:
    """Rank 1 (``where`` in ``procs``' dims) SIGKILLed once cold, then ``KILLS`` times with the standby warm; from
    each SIGKILL to the replacement's first answer."""
    from ._actors import TorchUser

    users = procs.spawn("users", TorchUser)
    users.total.call().get(timeout=120)  # the ranks import torch
    one = users.slice(**where)
    rank = 1  # ``where`` names rank 1 of the 2
    # Cold first: killed before the healer's next look (restart_warm_every) finds torch,
    # the replacement forks from the template without it and imports it itself.
    t0 = time.monotonic()
    os.kill(procs.rank_states()[rank]["pid"], signal.SIGKILL)
    procs.wait_restart(after=0, timeout=60)
    one.total.call_one().get(timeout=60)
    cold = time.monotonic() - t0
    log(f"{name}: cold: answered {cold:.3f} s after the SIGKILL")
    deadline = time.monotonic() + 120
    while "torch" not in procs.warm_standby():
        if time.monotonic() > deadline:
            raise TimeoutError("the standby template did not import torch within 120 s")
        time.sleep(0.2)
    answered, events = [], []
    for k in range(KILLS):
        pid = procs.rank_states()[rank]["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        event = procs.wait_restart(after=k + 1, timeout=60)
        one.total.call_one().get(timeout=60)
        answered.append(time.monotonic() - t0)
        events.append(event.seconds)
        log(f"{name}: kill {k + 1}: answered {answered[-1]:.3f} s after the SIGKILL "
            f"(the event says {event.seconds:.3f} s)")
    return {f"{name}_death_to_answer_s": {"median": round(statistics.median(answered), 3),
                                          "max": round(max(answered), 3)},
            f"{name}_event_s": {"median": round(statistics.median(events), 3)},
            f"{name}_cold_death_to_answer_s": round(cold, 3)}
