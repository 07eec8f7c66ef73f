"""SSHJob with ssh's own names: a ``Host`` alias only ssh's configuration knows (``-F FILE``),
and a ``ProxyJump`` through one simulated host to the other (cluster.py's ssh hosts)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import warnings

import psutil
import pytest
from support import cluster

from monarch_kernel import Actor, ProcessDied, endpoint
from monarch_kernel.job import SSHJob, UnreachableControllerWarning
from monarch_kernel.job.ssh_config import route_host, ssh_target
from monarch_kernel.runtime import config
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(120)
# What a script that imports this module puts on sys.path: its folder, and tests/ (the helpers).
SCRIPT_PATH = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


class Here(Actor):
    @endpoint
    def here(self) -> tuple:
        return os.uname().nodename, os.environ.get("MONARCH_KERNEL_BIND")


@pytest.fixture(scope="module")
def checkout_python(tmp_path_factory) -> str:
    """The interpreter with this checkout first on its path (agents run the code under test)."""
    return cluster.checkout_python(str(tmp_path_factory.mktemp("python")))


def ssh_config(ssh_hosts, tmp_path, entries: str) -> str:
    """An ssh configuration file: ``entries``, then the test hosts' key and options for all."""
    return cluster.ssh_config_file(ssh_hosts, str(tmp_path / "ssh_config"), entries)


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


def test_an_agent_slow_to_start_is_not_taken_for_one_out_of_reach(ssh_hosts, checkout_python, tmp_path):
    """reach_timeout counts from when the agent dials, not from the ssh command: a host whose
    python takes longer than that to start (a busy or cold host) is reached directly, with no
    warning and no second start through ssh."""
    slow = tmp_path / "python"
    slow.write_text(f'#!/bin/sh\nsleep 2\nexec {checkout_python} "$@"\n')
    slow.chmod(0o755)
    config.set("reach_timeout", 0.5)
    job = SSHJob(python_exe=str(slow), ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts[:1])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnreachableControllerWarning)
            procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
        got = procs.spawn("here", Here).here.call().get(timeout=30)
        assert list(got.values()) == [(ssh_hosts.names[0], ssh_hosts.hosts[0])]
    finally:
        config.set("reach_timeout", None)
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


# ------------------------------------------------------------ the controller's address

MOVES = '''
import os, subprocess, sys
sys.path[:0] = {tests!r}
from monarch_kernel import this_host
from monarch_kernel.job import SSHJob
from monarch_kernel.runtime import config
from monarch_kernel.runtime.process import Runtime
from test_ssh_reach import Here

rt = Runtime.current()
local = this_host().spawn_procs(per_host={{"gpus": 1}}).spawn("here", Here)
if sys.argv[1] == "loopback":  # an earlier out-of-cluster job listened there
    print("first", rt.network.listen("127.0.0.1").rsplit(":", 1)[0], flush=True)
else:  # an earlier job's network, gone since
    subprocess.run(["ip", "link", "add", {dummy!r}, "type", "veth", "peer", "name", {dummy!r} + "p"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", "10.254.{net}.1/32", "dev", {dummy!r}], check=True)
        subprocess.run(["ip", "link", "set", {dummy!r}, "up"], check=True)
        print("first", rt.network.listen("10.254.{net}.1").rsplit(":", 1)[0], flush=True)
    finally:
        subprocess.run(["ip", "link", "delete", {dummy!r}], check=True)
job = SSHJob(python_exe={python!r}, ssh_args={ssh_args!r}, out_of_cluster=False)
job.add_mesh("workers", [{host!r}])
try:
    got = job.state().workers.spawn_procs().spawn("here", Here).here.call().get(timeout=30)
    print("called", list(got.values())[0][0], rt.network.net_address.rsplit(":", 1)[0], flush=True)
finally:
    job.kill()
print("local", list(local.here.call().get(timeout=30).values())[0][0] == os.uname().nodename, flush=True)
'''


def test_a_controller_moves_off_the_loopback_or_a_network_that_is_gone(ssh_hosts, checkout_python, tmp_path):
    """The controller's first address came from an earlier job (the loopback, or a network
    that is gone since): a job whose hosts reach it elsewhere still starts, and a mesh on this
    host keeps answering."""
    if os.geteuid() != 0:
        pytest.skip("needs root to add and remove an address")
    tag = os.urandom(2).hex()
    net = int(tag[:2], 16)
    script = tmp_path / "moves.py"
    script.write_text(MOVES.format(tests=SCRIPT_PATH, python=checkout_python, net=net,
                                   ssh_args=ssh_hosts.ssh_args, host=ssh_hosts.hosts[0], dummy=f"mkmv{tag}"))
    for first, ip in (("loopback", "127.0.0.1"), ("gone", f"10.254.{net}.1")):
        out = subprocess.run([checkout_python, str(script), first], capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stderr[-4000:]
        assert out.stdout.splitlines() == [f"first tcp://{ip}", f"called {ssh_hosts.names[0]} "
                                           f"tcp://{ssh_hosts.controller_ip}", "local True"], out


VOID = '''
import sys, warnings
sys.path[:0] = {tests!r}
from monarch_kernel.job import SSHJob, UnreachableControllerWarning
from test_ssh_reach import Here

direct = SSHJob(python_exe={python!r}, ssh_args={ssh_args!r}, out_of_cluster=False)
direct.add_mesh("workers", [{host!r}])
try:
    direct.state()
except ConnectionError as e:
    print("direct:", str(e).splitlines()[0], flush=True)
direct.kill()
job = SSHJob(python_exe={python!r}, ssh_args={ssh_args!r})
job.add_mesh("workers", [{host!r}])
try:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = job.state().workers.spawn_procs().spawn("here", Here).here.call().get(timeout=30)
    print("auto:", list(got.values())[0][0], [type(w.message).__name__ for w in said], flush=True)
finally:
    job.kill()
'''


def test_a_host_whose_packets_to_the_controller_vanish_goes_through_ssh(ssh_hosts, checkout_python, tmp_path):
    """The host has a route to the controller's address, but nothing arrives (a gateway that
    is not there, as a firewall that drops): its agent says so, and the job takes the ssh path."""
    if os.geteuid() != 0:
        pytest.skip("needs root to add an address and a route")
    tag = os.urandom(2).hex()
    ip, dev = f"10.253.{int(tag[:2], 16)}.1", f"mkvd{tag}"
    host = ssh_hosts.hosts[1]
    void = host.rsplit(".", 1)[0] + ".99"  # on the hosts' subnet; no one answers its ARP
    script = tmp_path / "void.py"
    script.write_text(VOID.format(tests=SCRIPT_PATH, python=checkout_python,
                                  ssh_args=ssh_hosts.ssh_args, host=host))
    cluster.run(["ip", "link", "add", dev, "type", "veth", "peer", "name", dev + "p"])
    try:
        cluster.run(["ip", "addr", "add", f"{ip}/32", "dev", dev])
        cluster.run(["ip", "link", "set", dev, "up"])
        cluster.run(["ip", "-n", ssh_hosts.netns(host), "route", "add", f"{ip}/32", "via", void])
        out = subprocess.run([checkout_python, str(script)], capture_output=True, text=True, timeout=100,
                             env={**os.environ, "MONARCH_KERNEL_BIND": ip, "MONARCH_KERNEL_REACH_TIMEOUT": "30"})
    finally:
        cluster.run(["ip", "-n", ssh_hosts.netns(host), "route", "del", f"{ip}/32"], check=False)
        cluster.run(["ip", "link", "delete", dev], check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    direct, auto = out.stdout.splitlines()
    assert re.fullmatch(rf"direct: {host} heard nothing back from this controller's address tcp://{ip}:\d+: set "
                        r"MONARCH_KERNEL_BIND to one it can reach, or pass out_of_cluster=True to reach it through "
                        r"ssh; it said:", direct), out
    assert auto == f"auto: {ssh_hosts.names[1]} ['UnreachableControllerWarning']", out


# ------------------------------------------------------------ out of cluster

class Probe(Actor):
    @endpoint
    def where(self) -> tuple:
        return os.uname().nodename, os.environ.get("MONARCH_KERNEL_BIND")

    @endpoint
    def echo(self, x):
        print(f"echo {x}", flush=True)
        return x

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    @endpoint
    def ask(self, other, x):
        """Call another actor mesh (on the other compute host) from this rank."""
        return list(other.echo.call(x).get(timeout=30).values())

    @endpoint
    def dial(self, ip: str, port: int) -> str:
        """This rank's own attempt to open a connection to ``ip:port``."""
        try:
            socket.create_connection((ip, port), timeout=3).close()
        except OSError as e:
            return type(e).__name__
        return "connected"


@pytest.fixture(scope="module")
def walled():
    """A login node and two compute hosts with no route back to this process (cluster.py)."""
    with cluster.walled_network() as hosts:
        yield hosts


def _agent_pid(hosts, host: str) -> int:
    for pid in hosts.pids(host):
        with contextlib.suppress(psutil.Error):
            if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                return pid
    raise AssertionError(f"no agent on {host}")


def test_a_mesh_beyond_a_login_node_runs_through_the_agents_ssh(walled, checkout_python, tmp_path):
    login, c1, c2 = walled.hosts
    cfg = ssh_config(walled, tmp_path, f"Host login\n  HostName {login}\nHost gpu*\n  ProxyJump login\n"
                                       f"Host gpu1\n  HostName {c1}\nHost gpu2\n  HostName {c2}\n")
    # out_of_cluster=False: the agent has no route back, so the start fails as soon as it says so
    # (a generous deadline: ssh through the login node and python may be slow on a loaded machine).
    direct = SSHJob(python_exe=checkout_python, ssh_args=("-F", cfg), start_timeout=60, out_of_cluster=False)
    direct.add_mesh("workers", ["gpu1"])
    with pytest.raises(ConnectionError, match=r"^gpu1 has no route to this controller's address tcp://[0-9.:]+: set "
                                              r"MONARCH_KERNEL_BIND to one it can reach, or pass out_of_cluster=True "
                                              r"to reach it through ssh; it said:\n  monarch_kernel.agent: this host "
                                              r"has no route to the controller at tcp://"):
        direct.state()
    direct.kill()
    rt = Runtime.current()
    listened = rt.network.net_address  # an earlier test's job may have opened one already
    job = SSHJob(python_exe=checkout_python, ssh_args=("-F", cfg), out_of_cluster=True)
    job.add_mesh("workers", ["gpu1", "gpu2"])
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
        m = procs.spawn("probe", Probe)
        got = m.where.call().get(timeout=30)
        assert list(got.values()) == [(walled.names[1], c1)] * 2 + [(walled.names[2], c2)] * 2
        assert list(m.echo.call(5).get(timeout=30).values()) == [5] * 4
        # A call to all 4 ranks sends each host's ssh connection one message, and each host
        # answers with one, gathered there (a message of its own per rank waits on ssh's Nagle).
        sent, received = rt.transport.sent, rt.receiver.received
        for _ in range(20):
            assert len(m.where.call().get(timeout=30)) == 4  # prints nothing: no output messages
        assert (rt.transport.sent - sent) / 20 < 2.5 and (rt.receiver.received - received) / 20 < 2.5, \
            (rt.transport.sent - sent, rt.receiver.received - received)
        # A rank on one compute host calls the other's actors directly.
        assert m.slice(hosts=1, gpus=0).ask.call_one(m.slice(hosts=0), "x").get(timeout=30) == ["x", "x"]
        # The controller opened no port on a network, and a rank's own connection to the laptop fails.
        assert rt.network.net_address == listened or rt.network.net_address.startswith("tcp://127.0.0.1:")
        assert m.slice(hosts=0, gpus=0).dial.call_one(walled.controller_ip, 22).get(timeout=30) != "connected"
        # A compute host's death fails its ranks' calls, naming it.
        pending = m.slice(hosts=1).nap.call(30)
        time.sleep(0.3)
        os.kill(_agent_pid(walled, c2), signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(ProcessDied, match="gpu2"):
            pending.get(timeout=20)
        assert time.monotonic() - t < 5
        assert list(m.slice(hosts=0).echo.call(2).get(timeout=30).values()) == [2, 2]
    finally:
        job.kill()


def test_by_default_hosts_that_cannot_reach_the_controller_go_through_ssh(walled, checkout_python, tmp_path):
    """out_of_cluster=None (the default): the compute hosts' first agents cannot connect within
    reach_timeout, so they are ended (nothing of them is left on the hosts or in the launcher)
    and started again through their ssh connections; one warning, at the user's line, says so."""
    login, c1, c2 = walled.hosts
    cfg = ssh_config(walled, tmp_path, f"Host login\n  HostName {login}\nHost gpu*\n  ProxyJump login\n"
                                       f"Host gpu1\n  HostName {c1}\nHost gpu2\n  HostName {c2}\n")
    rt = Runtime.current()
    links_before = set(rt.launcher.links)
    job = SSHJob(python_exe=checkout_python, ssh_args=("-F", cfg))
    job.add_mesh("workers", ["gpu1", "gpu2"])
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            hosts = job.state().workers
        notices = [w for w in said if issubclass(w.category, UnreachableControllerWarning)]
        assert len(notices) == 1, [str(w.message) for w in said]
        assert str(notices[0].message).startswith("the agent on gpu1, gpu2 could not reach this controller (tcp://")
        assert "within 5 s" in str(notices[0].message)
        assert notices[0].filename == __file__
        # One agent per host (the first ones were ended there), and only their links are kept.
        assert [sum("monarch_kernel.agent" in " ".join(_cmdline(p)) for p in walled.pids(h)) for h in (c1, c2)] \
            == [1, 1]
        assert len(set(rt.launcher.links) - links_before) == 2
        procs = hosts.spawn_procs(per_host={"gpus": 2})
        m = procs.spawn("probe", Probe)
        got = list(m.where.call().get(timeout=30).values())
        assert got == [(walled.names[1], c1)] * 2 + [(walled.names[2], c2)] * 2
        assert m.slice(hosts=1, gpus=0).ask.call_one(m.slice(hosts=0), "y").get(timeout=30) == ["y", "y"]
    finally:
        job.kill()


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).cmdline()
    return []


def test_a_notebook_spawns_beyond_a_login_node(walled, checkout_python, tmp_path, kc):
    """``%mesh spawn --job ssh`` through a real kernel: by default the compute hosts are reached
    through ssh after the first try, and the cell says so once; ``--out-of-cluster`` takes that
    path at once, without a word."""
    from support.dap import Session

    login, c1, c2 = walled.hosts
    cfg = ssh_config(walled, tmp_path, f"Host login\n  HostName {login}\nHost gpu*\n  ProxyJump login\n"
                                       f"Host gpu1\n  HostName {c1}\nHost gpu2\n  HostName {c2}\n")
    s = Session(kc)
    ssh = f"--python {checkout_python} --ssh-args '-F {cfg}'"
    out = s.cell(f"procs = %mesh spawn --job ssh --hosts gpu1 -n 2 {ssh}")
    assert "mesh procs: 2 ranks on job ssh0" in out, out
    assert out.count("could not reach this controller") == 1 and "UnreachableControllerWarning" in out, out
    out = s.cell(f"b = %mesh spawn --job ssh --hosts gpu2 -n 1 --name b {ssh} --out-of-cluster")
    assert "mesh b: 1 rank on job ssh1" in out and "could not reach" not in out, out
    out = s.cell("%%mesh\nimport os\nprint(os.uname().nodename)")
    assert f"[rank 0] {walled.names[2]}" in out, out  # b is the current mesh
    # A second job through ssh to gpu1 cannot forward the controller's ports to where ssh0's do.
    out = s.cell(f"c = %mesh spawn --job ssh --hosts gpu1 -n 1 --name c {ssh} --out-of-cluster")
    assert re.search(r"cannot forward this controller's port \d+ to gpu1: port \d+ of gpu1's loopback is in use "
                     r"there \(another job of this controller that reaches gpu1 through ssh holds it: use that job, "
                     r"or kill it first", out), out
    for job in ("ssh0", "ssh1"):
        assert "killed" in s.cell(f"%mesh kill-job {job}")
