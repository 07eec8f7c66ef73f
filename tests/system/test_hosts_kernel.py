"""A notebook driving ranks on other hosts: ``%mesh spawn --job ssh`` through a real kernel,
JupyterLab's debugger stopping a remote rank at a breakpoint, distributed pdb on a remote
rank, ``%mesh status``/``jobs``/``stop``/``kill-job``.  The hosts are network namespaces with
their own sshd (cluster.py); the debugger reaches the rank's debugpy only through the
control connection (the rank's 127.0.0.1 is its own namespace's)."""

from __future__ import annotations

import shlex
import sys

import pytest
from support.dap import CELL, Session, start_debugger
from support.kernels import kernel, run, text

pytestmark = pytest.mark.timeout(150)


def test_a_notebook_spawns_over_ssh_and_debugs_a_remote_rank(ssh_hosts, kc):  # hosts checked after the kernel ends
    s = Session(kc)
    hosts = ",".join(ssh_hosts.hosts)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))  # one quoted word for the magic
    out = s.cell(f"procs = %mesh spawn --job ssh --hosts {hosts} -n 1 --python {sys.executable} --ssh-args {args}")
    assert "mesh procs: 2 ranks on job ssh0" in out, out
    status = s.cell("%mesh status")
    assert ssh_hosts.hosts[0] in status and ssh_hosts.hosts[1] in status, status
    assert "ssh0 (ssh): running" in s.cell("%mesh jobs")
    out = s.cell("%%mesh\nimport os\nprint(os.environ['MONARCH_KERNEL_BIND'])")
    assert f"[rank 0] {ssh_hosts.hosts[0]}" in out and f"[rank 1] {ssh_hosts.hosts[1]}" in out, out

    # JupyterLab's debugger on rank 1, on the second host.
    out = s.cell("%mesh debug 1")
    assert "now debugs rank 1" in out, out
    start_debugger(s)
    path = s.dap("dumpCell", {"code": CELL})["body"]["sourcePath"]
    bp = s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}], "sourceModified": False})
    assert bp["success"] and bp["body"]["breakpoints"][0]["verified"], bp
    assert s.dap("configurationDone")["success"]
    msg_id = s.execute(CELL)
    stopped = s.wait_event("stopped")
    thread = stopped["body"]["threadId"]
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 4)
    scopes = s.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    variables = s.dap("variables", {"variablesReference": scopes[0]["variablesReference"]})["body"]["variables"]
    assert {v["name"]: v["value"] for v in variables}["x"] == "10"
    assert s.dap("continue", {"threadId": thread})["success"]
    out = s.wait_done(msg_id)
    assert "[rank 1] y is 11" in out, out
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    s.cell("%mesh debug off")

    # Distributed pdb on the remote rank, over the notebook's stdin.
    out = s.cell("%%mesh --ranks 0\nv = 41\nbreakpoint()\nw = v + 1\nprint('w is', w)", ["p v", "c"])
    assert "rank 0 stopped at cell line 4" in out and "41" in out and "[rank 0] w is 42" in out, out

    out = s.cell("%mesh stop")
    assert "job ssh0 keeps its hosts" in out, out
    out = s.cell("procs = %mesh spawn --job ssh0 -n 2 --name again")
    assert "mesh again: 4 ranks on job ssh0" in out, out
    assert "killed with its meshes again" in s.cell("%mesh kill-job")
    assert "killed" in s.cell("%mesh jobs") or "no jobs" in s.cell("%mesh jobs")


def test_job_arguments_that_do_not_fit_say_what_to_type(kc):
    s = Session(kc)
    assert "UsageError" in s.cell("%mesh spawn --job ssh -n 2") and "--hosts h1,h2" in s.cell("%mesh spawn --job ssh")
    assert "go with --job" in s.cell("%mesh spawn --hosts a,b")
    assert "the name of a running job" in s.cell("%mesh spawn --job nope")
    assert "no jobs" in s.cell("%mesh jobs")
    assert "which job?" in s.cell("%mesh kill-job")


def test_a_notebook_spawns_on_slurm_and_kill_job_frees_the_allocation(slurm_cluster, kc):
    s = Session(kc)
    s.cell(f"%env SLURM_CONF={slurm_cluster.conf}")
    out = s.cell("procs = %mesh spawn --job slurm --nodes 2 -n 1 --time 00:10:00")
    assert "mesh procs: 2 ranks on job slurm0" in out, out
    out = s.cell("%%mesh\nimport socket\nprint(socket.gethostname())")
    assert all(f"[rank {r}] {node}" in out for r, node in enumerate(slurm_cluster.nodes)), out
    assert "slurm0 (slurm, Slurm job" in s.cell("%mesh jobs")
    assert len(slurm_cluster.jobs()) == 1
    assert "killed with its meshes procs" in s.cell("%mesh kill-job slurm0")
    assert slurm_cluster.jobs() == []


def test_a_detached_mesh_on_ssh_hosts_survives_its_kernel(ssh_hosts, kernelspec):
    hosts = ",".join(ssh_hosts.hosts)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))
    with kernel(kernelspec) as client:
        out, reply = run(client, f"procs = %mesh spawn -n 1 --detach farjob --job ssh --hosts {hosts} "
                                 f"--python {sys.executable} --ssh-args {args}", timeout=90)
        assert reply["status"] == "ok", text(out)
        out, reply = run(client, "%%mesh\nimport os\nstate = os.environ['MONARCH_KERNEL_BIND']\nprint('set')")
        assert "[ranks 0-1] set" in text(out), text(out)
    assert ssh_hosts.pids(ssh_hosts.hosts[0]), "the detached mesh's ranks outlive the kernel"
    with kernel(kernelspec) as client:
        out, reply = run(client, "%mesh list")
        assert "farjob: detached on a ssh job, running" in text(out), text(out)
        out, reply = run(client, "procs = %mesh attach farjob")
        assert reply["status"] == "ok", text(out)
        out, reply = run(client, "%%mesh\nstate")
        assert f"[rank 0] '{ssh_hosts.hosts[0]}'" in text(out) and f"[rank 1] '{ssh_hosts.hosts[1]}'" in text(out)
        out, reply = run(client, "%mesh stop farjob")
        assert reply["status"] == "ok", text(out)


def test_a_remote_ranks_traceback_shows_the_cell_source(ssh_hosts, kc):
    s = Session(kc)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))
    s.cell(f"procs = %mesh spawn --job ssh --hosts {ssh_hosts.hosts[1]} -n 1 --python {sys.executable} "
           f"--ssh-args {args}")
    out = s.cell("%%mesh\nvalue = 41\nratio = value / (value - 41)")
    assert "ZeroDivisionError" in out and "ratio = value / (value - 41)" in out, out
    s.cell("%mesh kill-job")


def test_pip_in_a_mesh_cell_runs_once_on_each_host(ssh_hosts, kc):
    # Two ranks on each of two hosts: %pip runs on rank 0 for host 0 and on rank 2 for host 1.
    import re

    s = Session(kc)
    hosts = ",".join(ssh_hosts.hosts)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))
    out = s.cell(f"procs = %mesh spawn --job ssh --hosts {hosts} -n 2 --python {sys.executable} --ssh-args {args}")
    assert "mesh procs: 4 ranks on job ssh" in out, out
    out = s.cell("%%mesh\n%pip --version\n_exit_code", timeout=120)
    labels = re.findall(r"^\[(ranks? [\d,-]+)\] pip \d+\S* from ", out, re.M)
    assert sorted(labels) in (["ranks 0,2"], ["rank 0", "rank 2"]), out  # once a host, not once a rank
    assert f"(host {ssh_hosts.hosts[0]}: ranks 0-1)" in out and f"(host {ssh_hosts.hosts[1]}: ranks 2-3)" in out, out
    assert "[ranks 0-3] 0" in out, out
    s.cell("%mesh kill-job")
