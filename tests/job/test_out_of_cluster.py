"""A controller no host can reach (a laptop beyond a login node), ``out_of_cluster=True``:
everything a reachable cluster does, with every connection between the controller and the
compute hosts carried by the ssh connections that started their agents (job/tunnels.py).
The topology is cluster.py's ``walled_network``: the test process is the laptop, ``login``
is reachable, ``gpu1``/``gpu2`` are reached through it and have no route back."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import time
import warnings
import zlib

import psutil
import pytest
from support import cluster
from support.dap import CELL, Session, start_debugger
from support.kernels import kernel, run, text

from monarch_kernel import Actor, ProcessDied, RDMABuffer, endpoint
from monarch_kernel.job import SSHJob

pytestmark = pytest.mark.timeout(150)

SIZE = 9 << 20  # over the data plane's size for two streams


@pytest.fixture(scope="module")
def walled():
    with cluster.walled_network() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    return cluster.checkout_python(str(tmp_path_factory.mktemp("python")))


@pytest.fixture(scope="module")
def cfg(walled, tmp_path_factory) -> str:
    return cluster.walled_ssh_config(walled, str(tmp_path_factory.mktemp("ssh") / "config"))


@pytest.fixture(scope="module")
def job(walled, python, cfg):
    """One job across gpu1 and gpu2 for the tests that drive it from this process."""
    job = SSHJob(python_exe=python, ssh_args=("-F", cfg), out_of_cluster=True)
    job.add_mesh("workers", ["gpu1", "gpu2"])
    try:
        yield job
    finally:
        job.kill()


@pytest.fixture(scope="module")
def procs(job):
    return job.state().workers.spawn_procs(per_host={"gpus": 1})


def pattern(seed: int, n: int = SIZE) -> bytearray:
    return bytearray((bytes((seed + i) % 256 for i in range(251)) * (n // 251 + 1))[:n])


class Holder(Actor):
    """Owns a buffer, and reads another rank's."""

    def __init__(self):
        self.data = bytearray()

    @endpoint
    def offer(self, seed: int) -> RDMABuffer:
        self.data = pattern(seed)
        return RDMABuffer(self.data)

    @endpoint
    def pull(self, buf: RDMABuffer) -> int:
        dst = bytearray(buf.size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf.read_into(dst).get(timeout=60)
        return zlib.crc32(dst)

    @endpoint
    def crc(self) -> int:
        return zlib.crc32(self.data)

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    @endpoint
    def dial(self, ip: str, port: int) -> str:
        """This rank's own attempt to open a connection to ``ip:port``."""
        try:
            socket.create_connection((ip, port), timeout=3).close()
        except OSError as e:
            return type(e).__name__
        return "connected"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit(self, code: int) -> None:
        os._exit(code)

    @endpoint
    def where(self) -> str:
        return os.uname().nodename


def test_rdma_between_compute_hosts_and_from_the_controller(procs, walled):
    """Rank to rank: straight between the compute hosts.  The controller's own reads and
    writes of a rank's buffer: through the ssh connection of that rank's host."""
    m = procs.spawn("holder", Holder)
    assert list(m.where.call().get(timeout=30).values()) == walled.names[1:]
    buf = m.slice(hosts=0).offer.call_one(3).get(timeout=30)
    assert m.slice(hosts=1).pull.call_one(buf).get(timeout=60) == zlib.crc32(pattern(3))
    got = bytearray(SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buf.read_into(got).get(timeout=60)
        assert got == pattern(3)
        buf.write_from(pattern(7)).get(timeout=60)
    assert m.slice(hosts=0).crc.call_one().get(timeout=30) == zlib.crc32(pattern(7))


def test_a_ranks_own_connection_to_the_laptop_fails(procs, walled):
    """The wall is real: a port on the laptop's address that the login node reaches is
    refused to a rank on a compute host, which still answers calls."""
    m = procs.spawn("dialer", Holder)
    with socket.create_server((walled.controller_ip, 0)) as server:
        port = server.getsockname()[1]
        login = walled.ssh(walled.hosts[0], f"python3 -c \"import socket; socket.create_connection("
                                            f"('{walled.controller_ip}', {port}), timeout=3); print('ok')\"")
        assert login.stdout.strip() == "ok", login.stderr
        assert m.slice(hosts=0).dial.call_one(walled.controller_ip, port).get(timeout=30) != "connected"


def test_stacks_of_ranks_beyond_the_login_node(procs):
    m = procs.spawn("sleeper", Holder)
    m.slice(hosts=1).nap.call_one(20)

    def napping(method: str | None):
        r = procs.stacks(method=method) if method else procs.stacks()
        return r if any(f.name.endswith("nap") for t in r.stacks[1].threads for f in t.frames) else None

    for method in (None, "py-spy"):
        deadline = time.monotonic() + 30
        while (report := napping(method)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert report is not None, procs.stacks()
        assert report.summary()[0].startswith("[rank 1] Holder.nap (test_out_of_cluster.py:"), report.summary()
    assert [s.method for s in report.stacks] == ["py-spy", "py-spy"]  # run by each host's agent


def _agent_pid(hosts, host: str) -> int:
    for pid in hosts.pids(host):
        with contextlib.suppress(psutil.Error):
            if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                return pid
    raise AssertionError(f"no agent on {host}")


def test_a_dead_rank_restarts_and_a_dead_agent_is_process_died_within_seconds(procs, walled):
    m = procs.spawn("victim", Holder)
    old = m.slice(hosts=1).pid.call_one().get(timeout=30)
    with pytest.raises(ProcessDied, match="exited with code 7"):
        m.slice(hosts=1).exit.call_one(7).get(timeout=30)
    procs.restart([1], [(m, Holder, (), {})])
    new = m.slice(hosts=1).pid.call_one().get(timeout=30)
    assert new != old and new in walled.pids(walled.hosts[2])  # a fresh process, on the same host
    pending = m.slice(hosts=1).nap.call_one(30)
    time.sleep(0.3)
    os.kill(_agent_pid(walled, walled.hosts[2]), signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(ProcessDied, match="gpu2"):
        pending.get(timeout=20)
    print(f"a killed agent seen as ProcessDied after {time.monotonic() - t:.2f} s")
    assert time.monotonic() - t < 5
    assert m.slice(hosts=0).where.call_one().get(timeout=30) == walled.names[1]


def _cmdline(pid: int) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).cmdline()
    return []


def test_a_cut_link_is_process_died_within_seconds(job, walled, python, cfg):
    """gpu1's cable is cut (its processes run on): its ranks' calls fail within seconds."""
    job.kill()  # the module's job is done; gpu1's ports are free for this one
    cut = SSHJob(python_exe=python, ssh_args=("-F", cfg), out_of_cluster=True)
    cut.add_mesh("workers", ["gpu1"])
    try:
        m = cut.state().workers.spawn_procs(per_host={"gpus": 1}).spawn("cut", Holder)
        pending = m.nap.call_one(60)
        time.sleep(0.3)
        walled.cut(walled.hosts[1])
        t = time.monotonic()
        with pytest.raises(ProcessDied, match="gpu1"):
            pending.get(timeout=30)
        took = time.monotonic() - t
        print(f"a cut link seen as ProcessDied after {took:.1f} s")
        assert took < 12, f"a cut link was seen after {took:.1f} s"
    finally:
        walled.restore(walled.hosts[1])
        cut.kill()
    # the cut host's processes were left running; they end once its link is back
    deadline = time.monotonic() + 30
    while [p for p in walled.pids(walled.hosts[1]) if "monarch_kernel" in " ".join(_cmdline(p))]:
        assert time.monotonic() < deadline, "the cut host's agent and ranks outlived their job"
        time.sleep(0.2)


# ------------------------------------------------------------ through a notebook

def _spawn(python: str, cfg: str) -> str:
    return f"--job ssh --hosts gpu1,gpu2 -n 1 --python {python} --ssh-args {shlex.quote('-F ' + cfg)} --out-of-cluster"


def test_a_notebook_beyond_a_login_node(walled, python, cfg, job, kc):
    """Output, JupyterLab's debugger on a compute host's rank, pdb on the other, ``%mesh
    stacks`` and ``%mesh restart`` of a dead rank, all through the notebook."""
    job.kill()
    s = Session(kc)
    out = s.cell(f"procs = %mesh spawn {_spawn(python, cfg)}", timeout=90)
    assert "mesh procs: 2 ranks on job ssh0" in out and "could not reach" not in out, out
    out = s.cell("%%mesh\nimport os\nprint(os.uname().nodename)")
    assert f"[rank 0] {walled.names[1]}" in out and f"[rank 1] {walled.names[2]}" in out, out

    out = s.cell("%mesh debug 1")
    assert "now debugs rank 1" in out, out
    start_debugger(s)
    path = s.dap("dumpCell", {"code": CELL})["body"]["sourcePath"]
    bp = s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}], "sourceModified": False})
    assert bp["success"] and bp["body"]["breakpoints"][0]["verified"], bp
    assert s.dap("configurationDone")["success"]
    msg_id = s.execute(CELL)
    thread = s.wait_event("stopped")["body"]["threadId"]
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 4)
    scopes = s.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    variables = s.dap("variables", {"variablesReference": scopes[0]["variablesReference"]})["body"]["variables"]
    assert {v["name"]: v["value"] for v in variables}["x"] == "10"
    assert s.dap("continue", {"threadId": thread})["success"]
    assert "[rank 1] y is 11" in s.wait_done(msg_id)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    s.cell("%mesh debug off")

    out = s.cell("%%mesh --ranks 0\nv = 41\nbreakpoint()\nw = v + 1\nprint('w is', w)", ["p v", "c"])
    assert "rank 0 stopped at cell line 4" in out and "41" in out and "[rank 0] w is 42" in out, out

    out = s.cell("%mesh stacks")
    assert "Stacks of mesh 'procs': 2 ranks" in out and "taken by in-process: ranks 0-1" in out, out

    out = s.cell("%%mesh --ranks 1\nimport os\nos._exit(3)")
    assert "exited with code 3" in out, out
    out = s.cell("%mesh restart")
    assert "restarted [rank 1] with fresh namespaces" in out, out
    out = s.cell("%%mesh\nimport os\nprint(os.uname().nodename)")
    assert f"[rank 0] {walled.names[1]}" in out and f"[rank 1] {walled.names[2]}" in out, out
    assert "killed" in s.cell("%mesh kill-job ssh0")


def test_a_port_another_program_holds_on_a_host_is_not_the_controllers(walled, python, cfg, job, kc):
    """Each controller port is forwarded to the same port of the host's loopback, where any
    program may hold it: the controller then listens at another port before any rank is given
    the address (``port_thief_cell``)."""
    job.kill()
    job_code = (f"from monarch_kernel.job import SSHJob\n"
                f"mine = SSHJob(python_exe={python!r}, ssh_args=('-F', {cfg!r}), out_of_cluster=True)\n"
                "mine.add_mesh('workers', ['gpu1'])")
    out = Session(kc).cell(cluster.port_thief_cell(walled.netns(walled.hosts[1]), job_code, "mine.state().workers"),
                           timeout=90)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out
    got = json.loads(lines[-1][len("RESULT "):])
    assert len(got["held"]) == 1 and got["held"][0][1] == "held", got
    assert got["host"] == walled.names[1], got
    assert got["held"][0][0] not in got["ports"], got  # the controller let that port go


def test_a_detached_mesh_beyond_a_login_node_survives_its_kernel(walled, python, cfg, job, kernelspec):
    job.kill()
    with kernel(kernelspec) as client:
        out, reply = run(client, f"procs = %mesh spawn --detach walled {_spawn(python, cfg)}", timeout=90)
        assert reply["status"] == "ok", text(out) + _host_log("walled")
        out, reply = run(client, "%%mesh\nimport os\nstate = os.uname().nodename\nprint('set')")
        assert "[ranks 0-1] set" in text(out), text(out)
        out, reply = run(client, "from monarch_kernel.runtime.process import Runtime\n"
                                 "print(Runtime.current().network.net_address)")
        port = int(text(out).strip().rsplit(":", 1)[1])
        assert port in _loopback_ports(walled, walled.hosts[1])  # the kernel's port, forwarded to gpu1
    # The kernel took its forwards back as it exited; the host process's own stay.
    deadline = time.monotonic() + 10
    while port in _loopback_ports(walled, walled.hosts[1]):
        assert time.monotonic() < deadline, "the exited kernel's port is still forwarded to gpu1"
        time.sleep(0.2)
    with kernel(kernelspec) as client:
        try:
            out, reply = run(client, "procs = %mesh attach walled", timeout=60)
            assert reply["status"] == "ok", text(out)
            out, reply = run(client, "%%mesh\nprint(state)")
            assert f"[rank 0] {walled.names[1]}" in text(out) and f"[rank 1] {walled.names[2]}" in text(out), \
                text(out)
        finally:
            out, reply = run(client, "%mesh stop walled", timeout=60)
        assert reply["status"] == "ok", text(out)


def _host_log(name: str) -> str:
    from monarch_kernel.detached import records

    with contextlib.suppress(OSError), open(records.log_path(name)) as f:
        return "\nthe mesh host's log:\n" + f.read()[-3000:]
    return ""


def _loopback_ports(hosts, host: str) -> set[int]:
    """The TCP ports listening on ``host``'s loopback."""
    out = hosts.in_host(host, "ss -ltnH").stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if " 127.0.0.1:" in line}
