"""The simulated clusters of ``cluster.py`` themselves: ssh reaches every host and runs this
environment's Python there under the host's own hostname, a wrong key fails fast, hosts
reach each other and the controller, a cut link drops a host until it is restored, and
what a test leaves on a host is found; Slurm runs a step across both nodes, cancels a
batch job, answers ``squeue --json``, and its tasks reach the controller.  The saved
``squeue --json`` samples (tests/fixtures) hold the layouts parsers must read."""

from __future__ import annotations

import json
import pathlib
import shlex
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from support.cluster import Network, SlurmCluster, SSHHosts, describe

pytestmark = pytest.mark.timeout(60)

DATA = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
PY = shlex.quote(sys.executable)


def _py(code: str) -> str:
    """A shell command that runs ``code`` with this test run's Python."""
    return f"{PY} -c {shlex.quote(code)}"


class _Listener:
    """A TCP listener in the root namespace that records the first line each client sends."""

    def __init__(self, addr: str):
        self.sock = socket.create_server((addr, 0))
        self.sock.settimeout(10)
        self.addr, self.port = self.sock.getsockname()[:2]
        self.got: list[tuple[str, str]] = []
        self.thread: threading.Thread | None = None

    def accept(self, n: int) -> None:
        def serve():
            for _ in range(n):
                try:
                    conn, (peer, _port) = self.sock.accept()
                except OSError:
                    return
                with conn:
                    conn.settimeout(5)
                    self.got.append((peer, conn.recv(200).decode()))

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(15)
        self.sock.close()


def _dial(addr: str, port: int) -> str:
    """Code that connects to addr:port and sends its hostname."""
    return (f"import socket; s = socket.create_connection(({addr!r}, {port}), timeout=5); "
            "s.sendall(socket.gethostname().encode()); s.close()")


# ------------------------------------------------------------------------- ssh


def test_ssh_runs_this_python_on_every_host_under_its_own_hostname(ssh_hosts: SSHHosts):
    assert len(ssh_hosts.hosts) >= 2 and len(set(ssh_hosts.hosts)) == len(ssh_hosts.hosts)
    for ip, name in zip(ssh_hosts.hosts, ssh_hosts.names, strict=True):
        r = ssh_hosts.ssh(ip, _py("import monarch_kernel, socket, sys; print(socket.gethostname(), sys.prefix)"))
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [name, sys.prefix]
        assert ssh_hosts.netns(ip) == ssh_hosts.netns(name)
    # The options a runtime passes to ssh work on their own, too.
    r = ssh_hosts.ssh(ssh_hosts.hosts[0], "echo $0; id -u")
    assert r.returncode == 0 and r.stdout.split()[-1] == "0"


def test_a_wrong_key_fails_fast_saying_permission_denied(ssh_hosts: SSHHosts):
    t = time.monotonic()
    r = ssh_hosts.ssh(ssh_hosts.hosts[0], "true", key=ssh_hosts.wrong_key, timeout=10)
    assert time.monotonic() - t < 5
    assert r.returncode == 255 and "Permission denied" in r.stderr


def test_hosts_reach_each_other_and_the_controller(ssh_hosts: SSHHosts):
    a, b = ssh_hosts.hosts[:2]
    # host a -> host b's sshd, by address and by hostname
    for target in (b, ssh_hosts.names[1]):
        r = ssh_hosts.ssh(a, _py(f"import socket; print(socket.create_connection(({target!r}, 22), 3).recv(8))"))
        assert r.returncode == 0 and "SSH-2.0" in r.stdout, r.stderr
    # every host -> a listener of the controller's, at the bridge address and by name
    listener = _Listener(ssh_hosts.controller_ip)
    try:
        listener.accept(2 * len(ssh_hosts.hosts))
        for ip in ssh_hosts.hosts:
            for target in (ssh_hosts.controller_ip, "mk-controller"):
                r = ssh_hosts.ssh(ip, _py(_dial(target, listener.port)))
                assert r.returncode == 0, r.stderr
    finally:
        listener.close()
    assert sorted(listener.got) == sorted((ip, name) for ip, name in zip(ssh_hosts.hosts, ssh_hosts.names,
                                                                           strict=True) for _ in range(2))


def _reaches(addr: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((addr, 22), timeout=timeout):
            return True
    except OSError:
        return False


def test_cut_drops_a_host_and_restore_brings_it_back(ssh_hosts: SSHHosts):
    a, b = ssh_hosts.hosts[:2]
    ssh_hosts.cut(b)
    assert not _reaches(b)  # dropped, not refused: the connect times out
    r = ssh_hosts.ssh(a, _py(f"import socket; socket.create_connection(({b!r}, 22), 1)"))
    assert r.returncode != 0 and "timed out" in r.stderr.lower()  # from the other host too
    assert _reaches(a)
    ssh_hosts.restore(b)
    assert _reaches(b, timeout=5)
    assert ssh_hosts.ssh(b, "hostname").stdout.strip() == ssh_hosts.names[1]


def test_processes_left_on_a_host_are_found_with_their_command_lines(ssh_hosts: SSHHosts):
    a = ssh_hosts.hosts[0]
    r = ssh_hosts.ssh(a, "setsid sleep 1234 </dev/null >/dev/null 2>&1 & echo $!")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) in ssh_hosts.pids(a)
    report = ssh_hosts.check_clean(grace=0.5)  # what the fixture runs after each test
    assert ssh_hosts.netns(a) in report and "sleep 1234" in report
    assert int(r.stdout) not in ssh_hosts.pids(a)  # and killed


def test_pids_leave_out_sshd_unless_asked(ssh_hosts: SSHHosts):
    def sleeps(pids):
        return [p for p in pids if "sleep 3.25" in describe([p])]

    def name(pid):
        try:
            return psutil.Process(pid).name()
        except psutil.Error:  # the root user's shell start-up runs short-lived helpers
            return ""

    a = ssh_hosts.hosts[0]
    with subprocess.Popen(["ssh", *ssh_hosts.ssh_args, a, "exec sleep 3.25"], stdin=subprocess.DEVNULL) as session:
        # Until the one sleep shows alone: a helper the shell forks at start-up carries the
        # same command line for a moment (fresh run C saw two).
        deadline = time.monotonic() + 5
        while True:
            mine = ssh_hosts.pids(a)
            if len(sleeps(mine)) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(sleeps(mine)) == 1
        assert "sshd" not in [name(p) for p in mine]
        assert "sshd" in [name(p) for p in ssh_hosts.pids(a, sshd_sessions=True)]
        session.wait(10)



KILLED_BUILDER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from support import cluster
with cluster.ssh_network(1) as hosts:
    print(json.dumps({"sshd": [p.pid for p in hosts.sshd], "namespaces": hosts.net.namespaces,
                      "bridge": hosts.net.bridge}), flush=True)
    time.sleep(600)
"""


def test_a_killed_test_process_leaves_no_daemon_and_the_next_sweep_removes_its_network(ssh_hosts: SSHHosts):
    """A pytest killed before its teardown: its sshd dies with it, and the namespaces and
    bridge it left are removed when the next network is built (this session's own network,
    ``ssh_hosts``, whose maker is alive, is kept)."""
    here = str(pathlib.Path(__file__).resolve().parents[1])  # tests/, above support/cluster.py
    with subprocess.Popen([sys.executable, "-c", KILLED_BUILDER, here], stdout=subprocess.PIPE, text=True) as builder:
        try:
            line = builder.stdout.readline()
            assert line, "the builder printed nothing"
            made = json.loads(line)
            sshd = [psutil.Process(pid) for pid in made["sshd"]]
        finally:
            builder.kill()
    gone, alive = psutil.wait_procs(sshd, timeout=10)
    assert not alive, f"sshd outlived the process that started it: {alive}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert all(ns in listed for ns in made["namespaces"]), listed  # left behind, until a sweep
    Network.sweep()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not any(ns in listed for ns in made["namespaces"]), listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert f" {made['bridge']}:" not in links, links
    assert ssh_hosts.ssh(ssh_hosts.hosts[0], "true").returncode == 0


# ------------------------------------------------------------------------- slurm


def test_srun_runs_one_task_on_each_node(slurm_cluster: SlurmCluster):
    r = slurm_cluster.run("srun", "-N2", "-n2", "sh", "-c", 'echo "$SLURM_PROCID $(hostname) $SLURMD_NODENAME"')
    rows = sorted(line.split() for line in r.stdout.splitlines())
    assert rows == [["0", "mkn1", "mkn1"], ["1", "mkn2", "mkn2"]]
    assert slurm_cluster.nodes == ["mkn1", "mkn2"] and slurm_cluster.partition == "mk"


def test_srun_sends_stdin_to_every_task(slurm_cluster: SlurmCluster):
    r = slurm_cluster.run("srun", "-N2", "-n2", "cat", input="hello\n")
    assert r.stdout.splitlines() == ["hello", "hello"]


def test_srun_tasks_run_this_python_and_reach_the_controller(slurm_cluster: SlurmCluster):
    listener = _Listener(slurm_cluster.controller_ip)
    try:
        listener.accept(2)
        slurm_cluster.run("srun", "-N2", "-n2", sys.executable, "-c", "import monarch_kernel; " +
                          _dial(socket.gethostname(), listener.port))  # the controller's own name resolves there
    finally:
        listener.close()
    assert sorted(listener.got) == sorted((ip, node) for node, ip in slurm_cluster.node_ips.items())


def test_scancel_ends_a_batch_job_and_squeue_json_shows_it(slurm_cluster: SlurmCluster):
    job = slurm_cluster.run("sbatch", "--parsable", "-N2", "-n2", "--wrap", "sleep 300").stdout.strip()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and [j["state"] for j in slurm_cluster.jobs()] != ["RUNNING"]:
        time.sleep(0.2)
    assert slurm_cluster.jobs() == [{"job_id": job, "state": "RUNNING", "nodes": "mkn[1-2]"}]
    data = slurm_cluster.squeue_json()
    [mine] = [j for j in data["jobs"] if str(j["job_id"]) == job]
    assert mine["job_state"] == "RUNNING" and mine["nodes"] == "mkn[1-2]"
    assert [n["nodename"] for n in mine["job_resources"]["allocated_nodes"]] == ["mkn1", "mkn2"]
    # The batch script runs on the first node; RUNNING can show before slurmstepd has forked it.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "sleep 300" not in describe(slurm_cluster.pids("mkn1")):
        time.sleep(0.1)
    assert "sleep 300" in describe(slurm_cluster.pids("mkn1"))
    slurm_cluster.run("scancel", job)
    deadline = time.monotonic() + 15
    while slurm_cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slurm_cluster.jobs() == []
    assert slurm_cluster.check_clean() == ""  # no job step process left on any node
    out = pathlib.Path(slurm_cluster.output_dir, f"slurm-{job}.out")  # not in the working directory
    assert "CANCELLED" in out.read_text() and not pathlib.Path(f"slurm-{job}.out").exists()


# ------------------------------------------------------------------------- squeue --json samples


def _state(job: dict) -> str:
    s = job["job_state"]
    return s[0] if isinstance(s, list) else s


def _allocated(job: dict) -> list[str]:
    res = job.get("job_resources") or {}
    if isinstance(res.get("nodes"), dict):  # 24.05+
        return [n["name"] for n in res["nodes"].get("allocation", [])]
    return [n["nodename"] for n in res.get("allocated_nodes", [])]  # 22.05, 23.x


@pytest.mark.parametrize("name", ["squeue-22.05.json", "squeue-24.05.json"])
def test_squeue_samples_hold_a_running_and_a_pending_job(name: str):
    data = json.loads((DATA / name).read_text())
    got = [(j["job_id"], j["name"], _state(j), j["nodes"], _allocated(j)) for j in data["jobs"]]
    assert got == [(1, "mesh-ranks", "RUNNING", "mkn[1-2]", ["mkn1", "mkn2"]),
                   (2, "mesh-waiting", "PENDING", "", [])]
