"""The DAP tunnel: the kernel reaches a rank's debugpy only through the rank's relay (actor
messages on the job's own connection), never with a socket of its own, and the relay reaches
it through a socket pair its adapter was handed, not a port.  Real ranks, a real debugpy on
each, and a real kernel driven as JupyterLab's panel drives it; one test puts the rank in
another network namespace, where the kernel could not reach the rank's loopback even if it
tried, and checks ``--listen`` prints the ssh port-forward that would."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import statistics
import sys
import threading
import time

import psutil
import pytest
from support.dap import INITIALIZE, Session, start_debugger
from support.kernels import kernel, run, text

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.debug.controller import proxy
from monarch_kernel.debug.controller.tunnel import TunnelConnection
from monarch_kernel.debug.messages import DapClosed, RankHost
from monarch_kernel.debug.rank.relay import DapRelay

pytestmark = pytest.mark.timeout(120)



class DebugpyStarter(Actor):
    @endpoint
    def start(self) -> str:
        from monarch_kernel.debug.rank import rank_debugpy

        return rank_debugpy.start()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _tcp_to(port: int, pid: int) -> list:
    """TCP connections of process ``pid`` whose far end is ``port``."""
    return [c for c in psutil.Process(pid).net_connections("tcp") if c.raddr and c.raddr.port == port]


def _adapter(rank_pid: int) -> psutil.Process:
    """Rank ``rank_pid``'s debug adapter (its one child running debug_adapter)."""
    found = [p for p in psutil.Process(rank_pid).children() if "debug_adapter" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def _relay_reaches_debugpy_by_a_socket_pair(rank_pid: int, kernel_pid: int) -> None:
    """The adapter's only TCP port is pydevd's, on loopback, connected to by the rank alone;
    the kernel has no socket to it; the relay's session is a unix socket pair (no path)."""
    adapter = _adapter(rank_pid)
    listening = [c.laddr for c in adapter.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert len(listening) == 1 and listening[0].ip == "127.0.0.1", listening
    port = listening[0].port
    assert set(_loopback_listeners(adapter.pid, port)) == {"127.0.0.1"}
    assert not _tcp_to(port, kernel_pid), _tcp_to(port, kernel_pid)
    assert len(_tcp_to(port, rank_pid)) == 1, "pydevd is not what is connected to the adapter's port"
    streams = [c for c in adapter.net_connections("unix") if c.type == socket.SOCK_STREAM]
    assert streams and all(not c.laddr and not c.raddr for c in streams), streams


def _loopback_listeners(pid: int, port: int) -> list[str]:
    """The local addresses that sockets in ``pid``'s network namespace listen on at ``port``
    (read from /proc/PID/net, so it works for a process in another namespace)."""
    found = []
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    found.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]) if name == "tcp" else addr)
    return found


def test_a_dap_session_through_the_relay_and_its_round_trip():
    with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
        relay = procs.spawn("relay", DapRelay)  # before debugpy starts, as the kernel does
        starter = procs.spawn("starter", DebugpyStarter)
        starter.start.call_one().get(timeout=60)
        rank_pid = starter.pid.call_one().get(timeout=30)
        events: list[str] = []
        initialized = threading.Event()

        def on_event(msg: dict) -> None:
            events.append(msg["event"])
            if msg["event"] == "initialized":
                initialized.set()

        closed = threading.Event()
        conn = TunnelConnection(relay, "rank 0", on_event, closed.set)
        try:
            assert conn.request("initialize", INITIALIZE).result(30)["success"]
            attach = conn.request("attach", {"justMyCode": False})
            assert initialized.wait(30), "timed out after 30 s waiting for debugpy's initialized event"
            assert conn.request("configurationDone").result(30)["success"]
            assert attach.result(30)["success"]
            # No port of debugpy's takes clients: the relay's session is a socket pair.
            _relay_reaches_debugpy_by_a_socket_pair(rank_pid, os.getpid())
            times = []
            for _ in range(30):
                start = time.perf_counter()
                reply = conn.request("threads").result(30)
                times.append(time.perf_counter() - start)
                assert reply["success"] and reply["body"]["threads"], reply
            median = statistics.median(times)
            print(f"DAP round trip through the tunnel: median {median * 1000:.2f} ms, "
                  f"max {max(times) * 1000:.2f} ms over {len(times)}")
            # About 3 ms here (debugpy alone answers in about 1.5 ms); the bound leaves room for a busy machine.
            assert median < 0.025, f"a DAP round trip through the tunnel took {median * 1000:.1f} ms (median)"
        finally:
            conn.close()
        assert closed.wait(10) and conn.closed
        with pytest.raises(ConnectionError, match="rank 0's debugpy .* has disconnected: the kernel closed it"):
            conn.request("threads").result(5)
        # The relay let go of debugpy, so a new session can start.
        again = TunnelConnection(relay, "rank 0", lambda _m: None)
        try:
            assert again.request("initialize", INITIALIZE).result(30)["success"]
        finally:
            again.close()


def test_a_rank_that_dies_fails_the_sessions_requests_at_once():
    with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
        relay = procs.spawn("relay", DapRelay)
        starter = procs.spawn("starter", DebugpyStarter)
        starter.start.call_one().get(timeout=60)
        rank_pid = starter.pid.call_one().get(timeout=30)
        closed = threading.Event()
        conn = TunnelConnection(relay, "rank 0", lambda _m: None, closed.set)
        assert conn.request("initialize", INITIALIZE).result(30)["success"]
        os.kill(rank_pid, signal.SIGKILL)
        assert closed.wait(10), "the session did not notice its rank died"
        with pytest.raises(ConnectionError, match=r"has disconnected: the rank is gone \(ProcessDied"):
            conn.request("threads").result(5)


def test_a_session_the_kernel_stops_renewing_ends_and_a_new_one_takes_over():
    from monarch_kernel import Channel
    from monarch_kernel.debug.messages import decode_tunnel

    with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
        relay = procs.spawn("relay", DapRelay)
        other = procs.spawn("other_relay", DapRelay)  # as another kernel's would be
        starter = procs.spawn("starter", DebugpyStarter)
        starter.start.call_one().get(timeout=60)
        # A kernel that opened a session and then died: it never renews it.
        port, receiver = Channel.open()
        link = relay.open.call_one(port, 0.5).get(timeout=30)
        pump = relay.pump.call_one(link)
        got = [decode_tunnel(receiver.recv().get(timeout=10))]
        while not isinstance(got[-1], DapClosed):
            got.append(decode_tunnel(receiver.recv().get(timeout=10)))
        closed = got[-1]
        assert closed.link == link and closed.reason == "the kernel did not renew the session within 0.5 s"
        assert "did not renew" in pump.get(timeout=10)
        # One session per rank: a new one, through any relay, ends the one before.
        first = TunnelConnection(relay, "rank 0", lambda _m: None)
        ended = threading.Event()
        first._on_close = ended.set
        second = TunnelConnection(other, "rank 0", lambda _m: None)
        try:
            assert ended.wait(10), "the first session was not ended by the second"
            with pytest.raises(ConnectionError, match="a new session took over"):
                first.request("threads").result(5)
            assert second.request("initialize", INITIALIZE).result(30)["success"]
        finally:
            second.close()


def test_sessions_ended_as_soon_as_they_open_leave_the_rank_debuggable():
    """debugpy's adapter accepts clients one at a time on one thread, which dies if the
    client it is accepting goes away meanwhile: every later session would then wait
    forever.  Each session here is ended by the next one the moment its open returns."""
    from monarch_kernel import Channel

    with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
        relays = [procs.spawn("relay", DapRelay), procs.spawn("other_relay", DapRelay)]
        starter = procs.spawn("starter", DebugpyStarter)
        starter.start.call_one().get(timeout=60)
        for i in range(12):
            port, _receiver = Channel.open()
            link = relays[i % 2].open.call_one(port, 30.0).get(timeout=30)
            relays[i % 2].pump.call_one(link)
        last = TunnelConnection(relays[0], "rank 0", lambda _m: None)
        try:
            assert last.request("initialize", INITIALIZE).result(30)["success"]
        finally:
            last.close()


def test_where_a_rank_runs_decides_remote_and_the_ssh_line():
    here = socket.gethostname()
    from monarch_kernel.runtime.net import hosts

    local = RankHost(here, hosts.host_key(), ("127.0.0.1",))
    assert not proxy.is_remote(local) and not proxy.is_remote(local, here)
    assert proxy.is_remote(local, "gpu-node-7")  # the mesh says it runs elsewhere
    other_ns = RankHost(here, "boot/4026532999", ("10.9.0.2", "127.0.0.1"))
    assert proxy.is_remote(other_ns) and proxy.ssh_host(other_ns) == "10.9.0.2"
    far = RankHost("gpu-node-7", "other-boot/1", ("10.1.2.3", "127.0.0.1"))
    assert proxy.is_remote(far) and proxy.ssh_host(far) == "gpu-node-7"
    assert proxy.ssh_host(far, "gpu-node-7.cluster") == "gpu-node-7.cluster"
    assert proxy.ssh_forward(5679, "127.0.0.1", 41234, "gpu-node-7") == "ssh -N -L 5679:127.0.0.1:41234 gpu-node-7"


def test_the_kernel_holds_no_connection_to_a_ranks_debugpy(kc):
    s = Session(kc)
    out = s.cell("procs = %mesh spawn -n 2\n%mesh debug 1")
    assert "now debugs rank 1 (the kernel reaches its debugpy through the rank's relay" in out, out
    kernel_pid = int(s.cell("import os\nos.getpid()").split()[-1])
    rank_pid = int(s.cell("%%mesh --ranks 1\nimport os\nos.getpid()").split()[-1])
    start_debugger(s)
    cell = "%%mesh --ranks 1\na = 6\nb = a * 7\nprint('b is', b)"
    path = s.dap("dumpCell", {"code": cell})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 3}]})["success"]
    assert s.dap("configurationDone")["success"]
    msg_id = s.execute(cell)
    thread = s.wait_event("stopped")["body"]["threadId"]
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 3)
    scopes = s.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    variables = s.dap("variables", {"variablesReference": scopes[0]["variablesReference"]})["body"]["variables"]
    assert {v["name"]: v["value"] for v in variables}["a"] == "6"
    # Stopped, with the panel's session live: the kernel has no socket to debugpy at all, and
    # debugpy takes no client on a port.
    _relay_reaches_debugpy_by_a_socket_pair(rank_pid, kernel_pid)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        assert s.dap("evaluate", {"expression": "a + 1", "frameId": frames[0]["id"], "context": "repl"})[
            "body"]["result"] == "7"
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"debug_request round trip (client -> kernel -> tunnel -> rank 1): median {median * 1000:.2f} ms")
    assert median < 0.05, f"an evaluate through the kernel and the tunnel took {median * 1000:.1f} ms (median)"
    assert s.dap("continue", {"threadId": thread})["success"]
    assert "[rank 1] b is 42" in s.wait_done(msg_id)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]



def test_a_rank_in_another_network_namespace_is_debugged_through_the_tunnel(kc, other_host):
    ns, address = other_host
    s = Session(kc)
    s.cell(f"procs = %mesh spawn -n 1 --env MONARCH_KERNEL_NETNS={ns}")
    kernel_pid = int(s.cell("import os\nos.getpid()").split()[-1])
    rank_pid = int(s.cell("%%mesh\nimport os\nos.getpid()").split()[-1])
    # --listen: the port is the kernel's, on this host's loopback; the rank listens for no client.
    out = s.cell("%mesh debug 0 --listen")
    assert "ssh -N -L" not in out.split(" first:")[0], out
    entry = json.loads(out[out.index("{"):])
    assert entry["connect"]["host"] == "127.0.0.1" and entry["monarchSessionSecret"], entry
    assert "127.0.0.1" in _loopback_listeners(kernel_pid, entry["connect"]["port"])
    assert not _loopback_listeners(rank_pid, entry["connect"]["port"])
    # JupyterLab's panel on that rank: a breakpoint stop, its stack and variables.
    out = s.cell("%mesh debug 0")
    assert f"now debugs rank 0 on {address} (the kernel reaches its debugpy through the rank's relay" in out, out
    start_debugger(s)
    cell = "%%mesh\nimport socket\nwhere = socket.gethostname()\nn = 5\nprint('n is', n)"
    path = s.dap("dumpCell", {"code": cell})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 5}]})["success"]
    assert s.dap("configurationDone")["success"]
    msg_id = s.execute(cell)
    thread = s.wait_event("stopped")["body"]["threadId"]
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 5)
    scopes = s.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    variables = s.dap("variables", {"variablesReference": scopes[0]["variablesReference"]})["body"]["variables"]
    assert {v["name"]: v["value"] for v in variables}["n"] == "5"
    assert s.dap("continue", {"threadId": thread})["success"]
    assert "[rank 0] n is 5" in s.wait_done(msg_id)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    s.cell("%mesh stop")


def test_listen_prints_an_entry_with_a_secret_of_its_own_each_time(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 1")
    entries = [json.loads(out[out.index("{"):]) for out in (s.cell("%mesh debug 0 --listen") for _ in range(2))]
    assert all(e["connect"]["host"] == "127.0.0.1" for e in entries)
    secrets = {e["monarchSessionSecret"] for e in entries}
    assert len(secrets) == 2 and all(len(x) >= 40 for x in secrets), secrets
    # The mesh stopped, its unused --listen port closes.
    s.cell("%mesh stop")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", entries[1]["connect"]["port"]), timeout=5).close()


def test_a_kernel_that_exits_lets_go_of_a_detached_ranks_debugpy(kernelspec, tmp_path):
    """A detached mesh outlives its kernel: breakpoints that kernel's panel set must not
    stop the rank once the kernel is gone (the panel that would continue it is gone too)."""
    done = tmp_path / "done"
    name = "dbgleft"
    with kernel(kernelspec) as client:
        s = Session(client)
        s.cell(f"procs = %mesh spawn -n 1 --detach {name}\n%mesh debug 0")
        start_debugger(s)
        cell = "%%mesh\ndef f(path):\n    v = 1\n    open(path, 'w').write('ran on')"
        path = s.dap("dumpCell", {"code": cell})["body"]["sourcePath"]
        assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}]})["success"]
        assert s.dap("configurationDone")["success"]
        s.cell(cell)  # defines f on the rank, with a breakpoint in it; the kernel then exits
    with kernel(kernelspec) as client:
        try:
            out, reply = run(client, f"procs = %mesh attach {name}")
            assert reply["status"] == "ok", text(out)
            out, reply = run(client, f"%%mesh\nf({str(done)!r})", timeout=30)
            assert reply["status"] == "ok" and done.read_text() == "ran on", text(out)
        finally:
            run(client, f"%mesh stop {name}")


def test_listen_on_a_rank_of_an_ssh_host_takes_vs_code_on_this_machine(kc, ssh_hosts):
    """The VS Code path for a rank on another host: the printed entry's port, on the
    kernel's machine, reaches the rank's debugpy through its relay; no forward to the rank."""
    from monarch_kernel.debug.dap import DapConnection

    s = Session(kc)
    hosts = ",".join(ssh_hosts.hosts)
    args = shlex.quote(" ".join(shlex.quote(a) for a in ssh_hosts.ssh_args))
    out = s.cell(f"procs = %mesh spawn --job ssh --hosts {hosts} -n 1 --python {sys.executable} --ssh-args {args}")
    assert "2 ranks on job" in out, out
    out = s.cell("%mesh debug 1 --listen")
    assert f"on {ssh_hosts.hosts[1]}" in out, out
    entry = json.loads(out[out.index("{"):])
    events: list[dict] = []
    conn = DapConnection(entry["connect"]["host"], entry["connect"]["port"], events.append)
    try:
        assert conn.request("initialize", {"adapterID": "python"}).result(10)["success"]
        attach = conn.request("attach", {"justMyCode": False, "monarchSessionSecret": entry["monarchSessionSecret"]})
        deadline = time.monotonic() + 30
        while not any(e.get("event") == "initialized" for e in events):
            assert time.monotonic() < deadline, "timed out after 30 s waiting for debugpy's initialized event"
            time.sleep(0.05)
        assert conn.request("configurationDone").result(30)["success"] and attach.result(30)["success"]
        threads = conn.request("threads").result(30)["body"]["threads"]
        assert threads, threads
        conn.request("disconnect", {"terminateDebuggee": False}).result(30)
    finally:
        conn.close()
    s.cell("%mesh stop")
    s.cell("%mesh kill-job")
