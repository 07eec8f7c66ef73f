"""``monarch-kernel`` on a detached mesh whose ranks run on a job's hosts (the simulated ssh
hosts, network namespaces): its kernel gone, the command line lists it, reads its stacks and
load through the hosts' connections, and kills its job."""

from __future__ import annotations

import json
import shlex
import sys
import time

import pytest
from support.cli import cli
from support.kernels import kernel, run, text

pytestmark = pytest.mark.timeout(240)


def test_a_detached_mesh_on_ssh_hosts_is_read_and_its_job_killed_with_no_kernel(ssh_hosts, kernelspec):
    hosts = ",".join(ssh_hosts.hosts)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))
    with kernel(kernelspec) as client:
        out, reply = run(client, f"procs = %mesh spawn -n 1 --detach farcli --job ssh --hosts {hosts} "
                                 f"--python {sys.executable} --ssh-args {args}", timeout=90)
        assert reply["status"] == "ok", text(out)
    try:
        rows = {r["name"]: r for r in json.loads(cli("ls", "--json")[1])}
        row = rows["farcli"]
        assert (row["kind"], row["state"], row["ranks"], row["job"]) == ("detached", "running", 2, "ssh job"), row
        code, out, err = cli("stacks", "farcli")
        assert code == 0, err
        assert out.startswith("Stacks of mesh 'farcli': 2 ranks in 1 group"), out
        code, out, err = cli("top", "farcli", "--count", "1", "--json")
        assert code == 0, err
        assert [r["host"] for r in json.loads(out)["ranks"]] == list(ssh_hosts.hosts), out
        code, out, err = cli("kill-job", "farcli")
        assert (code, out.strip()) == (0, "job of detached mesh 'farcli' killed with its mesh (ssh)"), err
        deadline = time.monotonic() + 15
        while ssh_hosts.pids(ssh_hosts.hosts[0]):
            assert time.monotonic() < deadline, "the job's ranks outlived kill-job"
            time.sleep(0.1)
    finally:
        if cli("stop", "farcli")[0] not in (0, 3):
            raise AssertionError("could not stop farcli")
