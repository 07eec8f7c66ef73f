"""SlurmJob(login=...): Slurm behind a login node, from a laptop the compute nodes cannot reach.

The session's Slurm cluster (cluster.py) gets a login namespace running sshd, with Slurm's
clients, one interface toward this process (the laptop) and one on the cluster's bridge; the
nodes have a ``prohibit`` route to the laptop's network.  sbatch, squeue, srun and scancel run
there over one ssh connection; the mesh's connections pass through it.  Checked: two nodes
answer calls, the laptop listens on loopback only and a rank cannot reach it, a node's death is
ProcessDied within seconds, kill() frees the allocation and leaves nothing on the login node,
dump()/job_load keep the login, and a bad login fails before anything is submitted."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

import psutil
import pytest
from cluster import checkout_interpreter, slurm_login

from monarch_kernel import Actor, ProcessDied, endpoint
from monarch_kernel.job import SlurmJob, job_load
from monarch_kernel.job.slurm import SlurmError
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(60)


class Node(Actor):
    @endpoint
    def host(self) -> str:
        return socket.gethostname()

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    @endpoint
    def dial(self, ip: str, port: int) -> str:
        """Open a connection to ``ip:port`` from this rank: what happened."""
        try:
            with socket.create_connection((ip, port), timeout=3):
                return "connected"
        except OSError as e:
            return type(e).__name__


@pytest.fixture(scope="module")
def login(slurm_cluster_session):
    with slurm_login(slurm_cluster_session) as node:
        yield node


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    return checkout_interpreter(str(tmp_path_factory.mktemp("python")))


@pytest.fixture
def slurm(slurm_cluster, login):
    """The cluster; after the test, nothing may be left on the login node either."""
    yield slurm_cluster
    report = login.hosts.check_clean()
    if report:
        pytest.fail(report, pytrace=False)


def _job(login, python, nodes: int = 2, **kw) -> SlurmJob:
    return SlurmJob(meshes={"m": nodes}, python_exe=python, login=login.login, ssh_args=login.hosts.ssh_args,
                    time_limit="00:10:00", **kw)


def _agent_pid(slurm, node: str) -> int:
    for pid in slurm.pids(node):
        with contextlib.suppress(psutil.Error):
            if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                return pid
    raise AssertionError(f"no agent on {node}")


def test_a_mesh_through_the_login_node_answers_and_the_laptop_opens_no_port(slurm, login, python, tmp_path):
    rt = Runtime.current()
    listened = rt.network.net_address  # an earlier test's job may have opened one already
    job = _job(login, python)
    try:
        t0 = time.monotonic()
        procs = job.state().m.spawn_procs(per_host={"gpus": 2})
        m = procs.spawn("node", Node)
        got = m.host.call().get(timeout=30)
        print(f"\nSlurm through a login node, 2x2: first answer {time.monotonic() - t0:.2f} s after state()")
        assert [got[{"hosts": h, "gpus": g}] for h in range(2) for g in range(2)] == [
            slurm.nodes[h] for h in range(2) for _ in range(2)]
        if listened is None:  # the laptop listens on its loopback only
            assert all(a.startswith("tcp://127.0.0.1:") for a in rt.network.tcp_addresses())
        # A rank's own connection to the laptop fails: no route (the login node forwards nothing).
        assert m.slice(hosts=0, gpus=0).dial.call_one(login.laptop_ip, 22).get(timeout=30) == "PermissionError"
        # Slurm saw the allocation; dump() keeps the login for job_load.
        assert [j["job_id"] for j in slurm.jobs()] == [job.job_id]
        job.dump(str(tmp_path / "job.json"))
        again = job_load(str(tmp_path / "job.json"))
        assert (again.login, again.ssh_args, again.job_id) == (job.login, job.ssh_args, job.job_id)
    finally:
        job.kill()
    assert slurm.jobs() == [] and not job.active
    deadline = time.monotonic() + 10
    while login.pids() and time.monotonic() < deadline:  # the relay and every srun session are gone
        time.sleep(0.1)
    assert login.pids() == []


def test_a_nodes_death_is_process_died_within_seconds(slurm, login, python):
    job = _job(login, python)
    try:
        m = job.state().m.spawn_procs(per_host={"gpus": 1}).spawn("node", Node)
        m.host.call().get(timeout=30)
        pending = m.slice(hosts=0).nap.call(30)
        time.sleep(0.3)
        os.kill(_agent_pid(slurm, slurm.nodes[0]), 9)
        t = time.monotonic()
        with pytest.raises(ProcessDied, match=slurm.nodes[0]):
            pending.get(timeout=20)
        assert time.monotonic() - t < 5
        assert m.slice(hosts=1).host.call_one().get(timeout=30) == slurm.nodes[1]  # the other node still answers
    finally:
        job.kill()
    assert slurm.jobs() == []


@pytest.mark.parametrize("how", ["wrong key", "unknown host"])
def test_a_bad_login_fails_before_anything_is_submitted(slurm, login, python, how):
    if how == "wrong key":
        job = SlurmJob(meshes={"m": 1}, python_exe=python, login=login.login,
                       ssh_args=login.hosts.ssh_args_for(login.hosts.wrong_key))
        said = r"authentication failed; check the user and key in login= and ssh_args="
    else:
        job = SlurmJob(meshes={"m": 1}, python_exe=python, login="root@mk-no-such-login.invalid",
                       ssh_args=login.hosts.ssh_args)
        said = r"ssh cannot resolve its name; check login="
    with pytest.raises(ConnectionError, match=rf"^cannot open an ssh connection to the login node \S+: {said}"):
        job.state()
    assert slurm.jobs() == [] and job.job_id is None
    job.kill()


def test_bad_arguments_say_what_to_type():
    with pytest.raises(ValueError, match="pass login='user@cluster'"):
        SlurmJob(meshes={"m": 1}, out_of_cluster=True)
    with pytest.raises(TypeError, match="not one string"):
        SlurmJob(meshes={"m": 1}, login="me@cluster", ssh_args="-i key")
    with pytest.raises(ValueError, match="login='me@cluster'"):
        SlurmJob(meshes={"m": 1}, login="-oProxyCommand=x")


def test_a_notebook_spawns_through_the_login_node_by_its_ssh_alias(slurm, login, python, tmp_path, kc):
    """``%mesh spawn --job slurm --login`` through a real kernel, the login node named by a Host
    alias that only the ``-F`` file knows; ``%mesh kill-job`` scancels over ssh."""
    from test_debug import Session

    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host cluster\n  HostName {login.hosts.hosts[0]}\n  User {login.hosts.user}\n"
                   f"  IdentityFile {login.hosts.key}\n  IdentitiesOnly yes\n  IdentityAgent none\n"
                   "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    s = Session(kc)
    out = s.cell(f"procs = %mesh spawn --job slurm --nodes 2 -n 1 --login cluster --ssh-args '-F {cfg}' "
                 f"--python {python}")
    assert "mesh procs: 2 ranks on job slurm0" in out, out
    out = s.cell("%%mesh\nimport socket\nprint(socket.gethostname())")
    assert f"[rank 0] {slurm.nodes[0]}" in out and f"[rank 1] {slurm.nodes[1]}" in out, out
    assert len(slurm.jobs()) == 1
    assert "killed" in s.cell("%mesh kill-job slurm0")
    assert slurm.jobs() == []
    out = s.cell("%mesh spawn --job ssh --hosts a --login cluster")
    assert "--login is a Slurm cluster's login node: type  --job slurm --nodes N --login cluster" in out, out


class Where(Actor):
    @endpoint
    def files(self) -> str:
        import monarch_kernel

        return monarch_kernel.__file__


def test_sync_env_through_the_login_node_finds_the_nodes_share_our_files(slurm, login, tmp_path):
    """sync_env=True: its probe runs as an srun step through the login node; these nodes see this
    controller's files (a shared file system), so nothing is sent and the agents run this
    controller's own interpreter with its sys.path folders (this checkout first)."""
    job = SlurmJob(meshes={"m": 1}, python_exe=sys.executable, login=login.login, ssh_args=login.hosts.ssh_args,
                   sync_env=str(tmp_path / "cache"))
    try:
        where = job.state().m.spawn_procs(per_host={"gpus": 1}).spawn("where", Where).files.call_one()
        assert where.get(timeout=30).startswith(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        synced = job.env_syncs[slurm.nodes[0]]
        assert synced.shared and synced.bytes_sent == 0 and synced.python == sys.executable
        assert not os.path.exists(tmp_path / "cache")
    finally:
        job.kill()
    assert slurm.jobs() == []


def test_a_second_job_through_the_same_login_node_says_what_holds_its_ports(slurm, login, python):
    """One controller's ports are relayed once per login node: a second job there fails, saying
    which, and its allocation is freed; the first carries on.  And a controller that listens on
    loopback only cannot take out_of_cluster=False."""
    first = _job(login, python, 1, exclusive=False)
    second = _job(login, python, 1, exclusive=False)
    try:
        m = first.state().m.spawn_procs(per_host={"gpus": 1}).spawn("node", Node)
        m.host.call_one().get(timeout=30)
        with pytest.raises(ConnectionError, match=r"the relay on the login node \S+ cannot listen at port \d+ for "
                                                  r"the nodes: .*in use \(another job of this controller"):
            second.state()
        assert [j["job_id"] for j in slurm.jobs()] == [first.job_id]
        if (Runtime.current().network.net_address or "").startswith("tcp://127."):
            direct = _job(login, python, 1, exclusive=False, out_of_cluster=False)
            with pytest.raises(SlurmError, match="listens on loopback only .*: pass out_of_cluster=True with login="):
                direct.state()
        assert m.host.call_one().get(timeout=30) in slurm.nodes
    finally:
        second.kill()
        first.kill()
    assert slurm.jobs() == []
