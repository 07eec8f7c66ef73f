"""SlurmJob(login=...): Slurm behind a login node, from a laptop the compute nodes cannot reach.

The session's Slurm cluster (cluster.py) gets a login namespace running sshd, with Slurm's
clients, one interface toward this machine (the laptop) and one on the cluster's bridge; the
nodes have a ``prohibit`` route to the laptop's network.  The laptop is a real kernel (the
module's): its runtime listens on loopback only, and this test process's own runtime, which
other modules share, is left alone.  sbatch, squeue, srun and scancel run on the login node
over one ssh connection; the mesh's connections pass through it.  Checked: two nodes answer
calls, every port the kernel listens on is on loopback and a rank cannot reach the laptop, a
node's death is ProcessDied within seconds, a second job shares the first's relay, kill() frees
the allocation and leaves nothing on the login node, dump()/job_load keep the login, ``%mesh
spawn --login`` by a Host alias, sync_env through the login node, and a bad login fails before
anything is submitted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time

import psutil
import pytest
from support.cluster import checkout_python, port_thief_cell, slurm_login

from monarch_kernel.job import SlurmJob, job_load

pytestmark = pytest.mark.timeout(60)

NODE = '''
import json, os, socket, sys, time
from monarch_kernel import Actor, ProcessDied, endpoint
from monarch_kernel.job import SlurmJob

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
        try:
            with socket.create_connection((ip, port), timeout=3):
                return "connected"
        except OSError as e:
            return type(e).__name__

    @endpoint
    def module(self) -> str:
        import monarch_kernel
        return monarch_kernel.__file__

def said(**kw):
    print("RESULT " + json.dumps(kw))
'''


@pytest.fixture(scope="module")
def login(slurm_cluster_session):
    with slurm_login(slurm_cluster_session) as node:
        yield node


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    return checkout_python(str(tmp_path_factory.mktemp("python")))


@pytest.fixture(scope="module")
def laptop(module_kc):
    """The module's kernel, as a notebook on the laptop: ``Node`` and ``said`` defined there."""
    from support.dap import Session

    s = Session(module_kc)
    out = s.cell(NODE + "said(pid=os.getpid())")
    s.pid = _result(out)["pid"]
    return s


@pytest.fixture
def slurm(slurm_cluster, login):
    """The cluster; after the test, nothing may be left on the login node either."""
    yield slurm_cluster
    report = login.hosts.check_clean()
    if report:
        pytest.fail(report, pytrace=False)


def _result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT "):])


def _job(login, python, nodes: int = 2, **kw) -> str:
    """The SlurmJob(...) expression for the kernel."""
    more = "".join(f", {k}={v!r}" for k, v in kw.items())
    return (f"SlurmJob(meshes={{'m': {nodes}}}, python_exe={python!r}, login={login.login!r}, "
            f"ssh_args={login.hosts.ssh_args!r}, time_limit='00:10:00'{more})")


def _agent_pid(slurm, node: str) -> int:
    for pid in slurm.pids(node):
        with contextlib.suppress(psutil.Error):
            if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                return pid
    raise AssertionError(f"no agent on {node}")


def _wait_login_empty(login) -> None:
    deadline = time.monotonic() + 10
    while login.pids() and time.monotonic() < deadline:  # the relay and every srun session are gone
        time.sleep(0.1)
    assert login.pids() == []


def test_a_mesh_through_the_login_node_answers_and_the_laptop_opens_no_port(slurm, login, python, laptop,
                                                                             tmp_path):
    path = str(tmp_path / "job.json")
    out = laptop.cell(f"""
t0 = time.monotonic()
job = {_job(login, python)}
m = job.state().m.spawn_procs(per_host={{"gpus": 2}}).spawn("node", Node)
got = m.host.call().get(timeout=30)
first = time.monotonic() - t0
job.dump({path!r})
said(hosts=[got[{{"hosts": h, "gpus": g}}] for h in range(2) for g in range(2)], first=first, job_id=job.job_id,
     dial=m.slice(hosts=0, gpus=0).dial.call_one({login.laptop_ip!r}, 22).get(timeout=30))
""")
    got = _result(out)
    print(f"\nSlurm through a login node, 2x2: first answer {got['first']:.2f} s after state()")
    assert got["hosts"] == [slurm.nodes[h] for h in range(2) for _ in range(2)]
    assert got["dial"] == "PermissionError"  # a rank's own connection to the laptop: no route
    listening = [c.laddr for c in psutil.Process(laptop.pid).net_connections("inet") if c.status == "LISTEN"]
    assert listening and all(a.ip in ("127.0.0.1", "::1") for a in listening), listening  # loopback only
    assert [j["job_id"] for j in slurm.jobs()] == [got["job_id"]]
    again = job_load(path)  # dump() keeps the login (job_load here only reads it)
    assert (again.login, again.ssh_args, again.job_id) == (login.login, login.hosts.ssh_args, got["job_id"])
    laptop.cell("job.kill()")
    assert slurm.jobs() == []
    _wait_login_empty(login)


def test_a_nodes_death_is_process_died_within_seconds(slurm, login, python, laptop):
    out = laptop.cell(f"""
job = {_job(login, python)}
m = job.state().m.spawn_procs(per_host={{"gpus": 1}}).spawn("node", Node)
m.host.call().get(timeout=30)
pending = m.slice(hosts=0).nap.call(30)
said(ok=1)
""")
    assert _result(out) == {"ok": 1}
    time.sleep(0.3)
    os.kill(_agent_pid(slurm, slurm.nodes[0]), 9)
    killed = time.time()
    out = laptop.cell("""
try:
    pending.get(timeout=20)
    said(died=None)
except ProcessDied as e:
    said(died=str(e), at=time.time(), other=m.slice(hosts=1).host.call_one().get(timeout=30))
job.kill()
""")
    got = _result(out)
    assert slurm.nodes[0] in got["died"], got
    assert got["at"] - killed < 5, got
    assert got["other"] == slurm.nodes[1]  # the other node still answers
    assert slurm.jobs() == []
    _wait_login_empty(login)


def test_a_second_job_through_the_same_login_node_shares_its_relay(slurm, login, python, laptop):
    """One kernel relays its ports once per login node: a second job there (a cell run again)
    shares that relay and runs beside the first, and killing it leaves the first running.  And
    out_of_cluster=False is refused while the first job's hosts know the kernel by its loopback
    address."""
    out = laptop.cell(f"""
first = {_job(login, python, 1, exclusive=False)}
m = first.state().m.spawn_procs(per_host={{"gpus": 1}}).spawn("node", Node)
m.host.call_one().get(timeout=30)
second = {_job(login, python, 1, exclusive=False)}
m2 = second.state().m.spawn_procs(per_host={{"gpus": 1}}).spawn("node", Node)
hosts = [m2.host.call_one().get(timeout=30)]
jobs = sorted([first.job_id, second.job_id])
second.kill()
direct = {_job(login, python, 1, exclusive=False, out_of_cluster=False)}
try:
    direct.state()
    error = None
except Exception as e:
    error = f"{{type(e).__name__}}: {{e}}"
direct.kill()
said(error=error, jobs=jobs, hosts=hosts, first=first.job_id, again=m.host.call_one().get(timeout=30))
""")
    got = _result(out)
    assert got["hosts"][0] in slurm.nodes and len(set(got["jobs"])) == 2, got
    assert got["error"].startswith("ConnectionError: this controller listens on 127.0.0.1 only, for its jobs "
                                   "whose hosts reach it through ssh"), got
    assert "pass out_of_cluster=True for this job too" in got["error"]
    assert got["again"] in slurm.nodes
    assert [j["job_id"] for j in slurm.jobs()] == [got["first"]]
    laptop.cell("first.kill()")
    assert slurm.jobs() == []
    _wait_login_empty(login)


def test_a_port_another_program_holds_on_the_login_node_is_not_the_controllers(slurm, login, python, laptop):
    """The relay listens at the controller's own port numbers on the login node, where any
    program (an srun, another user's) may hold one: the controller then listens at another
    port, before any rank is given the address (``port_thief_cell``)."""
    out = laptop.cell(port_thief_cell(login.hosts.netns(login.hosts.hosts[0]), f"mine = {_job(login, python, 1)}",
                                      "mine.state().m"))
    got = _result(out)
    assert len(got["held"]) == 1 and got["held"][0][1] == "held", got
    assert got["host"] in slurm.nodes, got
    assert got["held"][0][0] not in got["ports"], got  # the controller let that port go
    assert slurm.jobs() == []
    _wait_login_empty(login)


def test_sync_env_through_the_login_node_finds_the_nodes_share_our_files(slurm, login, laptop, tmp_path):
    """sync_env=True: its probe runs as an srun step through the login node; these nodes see this
    kernel's files (a shared file system), so nothing is sent and the agents run the kernel's own
    interpreter with its sys.path folders (this checkout first)."""
    cache = str(tmp_path / "cache")
    out = laptop.cell(f"""
job = {_job(login, sys.executable, 1, sync_env=cache)}
try:
    where = job.state().m.spawn_procs(per_host={{"gpus": 1}}).spawn("node", Node).module.call_one().get(timeout=30)
    e = job.env_syncs[job.nodes[0]]
    said(where=where, shared=e.shared, sent=e.bytes_sent, python=e.python)
finally:
    job.kill()
""")
    got = _result(out)
    assert got["where"].startswith(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), got
    assert got["shared"] and got["sent"] == 0 and got["python"] == sys.executable, got
    assert not os.path.exists(cache) and slurm.jobs() == []


def test_a_notebook_spawns_through_the_login_node_by_its_ssh_alias(slurm, login, python, laptop, tmp_path):
    """``%mesh spawn --job slurm --login`` through the kernel, the login node named by a Host
    alias that only the ``-F`` file knows; ``%mesh kill-job`` scancels over ssh."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host cluster\n  HostName {login.hosts.hosts[0]}\n  User {login.hosts.user}\n"
                   f"  IdentityFile {login.hosts.key}\n  IdentitiesOnly yes\n  IdentityAgent none\n"
                   "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    out = laptop.cell(f"procs = %mesh spawn --job slurm --nodes 2 -n 1 --login cluster --ssh-args '-F {cfg}' "
                      f"--python {python}")
    assert re.search(r"mesh procs\d*: 2 ranks on job slurm0", out), out
    out = laptop.cell("%%mesh\nimport socket\nprint(socket.gethostname())")
    assert f"[rank 0] {slurm.nodes[0]}" in out and f"[rank 1] {slurm.nodes[1]}" in out, out
    assert len(slurm.jobs()) == 1
    assert "killed" in laptop.cell("%mesh kill-job slurm0")
    assert slurm.jobs() == []
    out = laptop.cell("%mesh spawn --job ssh --hosts a --login cluster")
    assert "--login is a Slurm cluster's login node: type  --job slurm --nodes N --login cluster" in out, out


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
