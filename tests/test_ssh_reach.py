"""SSHJob with ssh's own names: a ``Host`` alias only ssh's configuration knows (``-F FILE``),
and a ``ProxyJump`` through one simulated host to the other (cluster.py's ssh hosts)."""

from __future__ import annotations

import os
import sys

import pytest

from monarch_kernel import Actor, endpoint
from monarch_kernel.job import SSHJob
from monarch_kernel.job.ssh_config import route_host, ssh_target

pytestmark = pytest.mark.timeout(120)


class Here(Actor):
    @endpoint
    def here(self) -> tuple:
        return os.uname().nodename, os.environ.get("MONARCH_KERNEL_BIND")


@pytest.fixture(scope="module")
def checkout_python(tmp_path_factory) -> str:
    """The interpreter with this checkout first on its path (agents run the code under test)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path_factory.mktemp("python") / "python"
    path.write_text(f'#!/bin/sh\nexport PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def ssh_config(ssh_hosts, tmp_path, entries: str) -> str:
    """An ssh configuration file: ``entries``, then the test hosts' key and options for all."""
    path = tmp_path / "ssh_config"
    path.write_text(entries + f"""
Host *
  User {ssh_hosts.user}
  IdentityFile {ssh_hosts.key}
  IdentitiesOnly yes
  IdentityAgent none
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 5
""")
    return str(path)


def test_host_aliases_from_an_ssh_config_file(ssh_hosts, checkout_python, tmp_path):
    h1, h2 = ssh_hosts.hosts
    cfg = ssh_config(ssh_hosts, tmp_path, f"Host gpu1\n  HostName {h1}\nHost gpu2\n  HostName {h2}\n")
    assert ssh_target("gpu1", ("-F", cfg)).hostname == h1
    job = SSHJob(python_exe=checkout_python, ssh_args=("-F", cfg))
    job.add_mesh("workers", ["gpu1", "gpu2"])
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
        got = procs.spawn("here", Here).here.call().get(timeout=30)
        assert sorted(got.values()) == sorted(zip(ssh_hosts.names, ssh_hosts.hosts, strict=True))
    finally:
        job.kill()


def test_a_name_nothing_resolves_says_what_to_write(ssh_hosts, tmp_path):
    cfg = ssh_config(ssh_hosts, tmp_path, "")
    with pytest.raises(ConnectionError, match=r"cannot resolve host 'nowhere-gpu': ssh's configuration names it "
                                              r"'nowhere-gpu'.*HostName in ~/.ssh/config"):
        route_host("nowhere-gpu", ("-F", cfg))


def test_a_far_host_through_a_jump_host(ssh_hosts, checkout_python, tmp_path):
    """``far`` is reached through the first host (ProxyJump in the config file, and ``-J``):
    the far host's sshd sees the connection come from the jump host's address."""
    h1, h2 = ssh_hosts.hosts
    far = ssh_hosts.names[1]
    cfg = ssh_config(ssh_hosts, tmp_path, f"Host jump\n  HostName {h1}\nHost far\n  HostName {h2}\n  ProxyJump jump\n")
    for args, name in ((("-F", cfg), "far"), (("-F", cfg, "-J", "jump"), h2)):
        with open(ssh_hosts.logs[1]) as f:
            f.seek(0, os.SEEK_END)
            before = f.tell()
        job = SSHJob(python_exe=checkout_python, ssh_args=args)
        job.add_mesh("workers", [name])
        try:
            procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
            got = procs.spawn("here", Here).here.call().get(timeout=30)
            assert list(got.values()) == [(far, h2)] * 2
        finally:
            job.kill()
        with open(ssh_hosts.logs[1]) as f:
            f.seek(before)
            log = f.read()
        assert f"Accepted publickey for root from {h1} " in log, log
