"""A job's history: each host's agent writes its own ranks' lines and metrics on that host, and
the controller copies them home through the job's agents, so the history answers after the
hosts are gone; with a shared folder, every host writes straight into it.  On simulated hosts
(network namespaces, each with its own sshd: support/cluster.py)."""

from __future__ import annotations

import os
import shutil
import socket
import sys

import pytest
from support.actors import Talker
from support.config import configured

import monarch_kernel
from monarch_kernel.job import SSHJob

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def checkout_python(tmp_path_factory) -> str:
    """The interpreter with this checkout first on its path (agents over ssh run the code under test)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = tmp_path_factory.mktemp("python") / "python"
    path.write_text(f'#!/bin/sh\nexport PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _run_job(ssh_hosts, checkout_python, env: dict) -> list[str]:
    job = SSHJob(python_exe=checkout_python, ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts)
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 2}, name="h-job", env=env)
        t = procs.spawn("t", Talker)
        t.talk.call(30).get(timeout=60)
        hosts = list(procs.ref.hosts)
        procs.stop().get(timeout=60)
    finally:
        job.kill()  # the agents end: what they wrote is copied home first
    return hosts


def test_a_jobs_history_is_copied_home_and_answers_after_its_hosts_are_gone(ssh_hosts, checkout_python, tmp_path):
    home, away = tmp_path / "home", tmp_path / "hosts"
    with configured(history_dir=str(home), history_flush=0.2):
        hosts = _run_job(ssh_hosts, checkout_python, {"MONARCH_KERNEL_HISTORY_DIR": str(away)})
        assert (away / "h-job").is_dir(), "the hosts wrote no history of their own"
        shutil.rmtree(away)  # the allocation is gone, and its disks with it
        h = monarch_kernel.history("h-job")
        got = h.sql("SELECT host, rank, count(*) AS n FROM lines GROUP BY host, rank ORDER BY rank")
        assert got["rank"].tolist() == [0, 1, 2, 3] and got["n"].tolist() == [30] * 4
        assert got["host"].tolist() == hosts  # each rank's lines come from its own host's files
        m = h.sql("SELECT rank, count(*) AS n FROM metrics GROUP BY rank ORDER BY rank")
        assert m["n"].tolist() == [30] * 4
        assert sorted(h.sql("SELECT DISTINCT kind FROM events")["kind"]) == ["spawn", "stop"]
        for folder in (home / "h-job").iterdir():
            assert oct(folder.stat().st_mode & 0o777) == "0o700"
        rec = {r.name: r for r in monarch_kernel.history.list_histories()}["h-job"]
        assert rec.kind == "job" and set(hosts) <= set(rec.hosts)


def test_with_a_shared_folder_every_host_writes_into_it(ssh_hosts, checkout_python, tmp_path):
    shared = tmp_path / "shared"
    with configured(history_dir=str(shared), history_flush=0.2):
        hosts = _run_job(ssh_hosts, checkout_python, {})
        got = monarch_kernel.history("h-job").sql("SELECT host, count(*) AS n FROM lines GROUP BY host ORDER BY host")
        assert got["host"].tolist() == sorted(set(hosts)) and got["n"].tolist() == [60, 60]
        # the hosts write under the run the controller spawned: one run folder, every host's in it
        (run,) = [r for r in monarch_kernel.history.list_histories() if r.name == "h-job"]
        assert run.folder.parent == shared / "h-job" and list(run.folder.parent.iterdir()) == [run.folder]
        assert {p.name for p in run.folder.iterdir()} == set(hosts) | {socket.gethostname()}, run.folder
