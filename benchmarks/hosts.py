"""W9: across two hosts (network namespaces with their own sshd, built as the tests build
them: tests/support/cluster.py).  W1 through ``SSHJob`` for 2 hosts x 2 ranks (time to the first
answer); W2 and W3 with the ranks on the other host beside the same ranks here; a raw pyzmq
round trip between the same namespaces (plain and with Curve); W4b (``tcp``) between the
hosts beside raw TCP ``sendall``/``recv_into`` between the same namespaces; W5x, the time
from a host's death (its agent SIGKILLed; its link cut) to the caller's ``ProcessDied``.
Needs root (network namespaces, sshd); otherwise it reports why it did not run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ._util import ROOT, log, summary_us, time_calls

NBYTES = 64 << 20

_ECHO = r"""
import sys, zmq
ctx = zmq.Context()
ip, curve, secret, server = sys.argv[1], sys.argv[2] == "1", sys.argv[3].encode(), sys.argv[4].encode()
pull = ctx.socket(zmq.PULL)
if curve:
    pull.curve_server, pull.curve_secretkey = True, secret
pull.bind(f"tcp://{ip}:*")
print(pull.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
push = None
while True:
    f = pull.recv_multipart()
    if push is None:
        push = ctx.socket(zmq.PUSH)
        if curve:
            push.curve_serverkey = server
            push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
        push.connect(f[0].decode())
    push.send_multipart(f)
"""

_SINK = r"""
import socket, sys
ip, n, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ls = socket.socket(); ls.bind((ip, 0)); ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
view = memoryview(bytearray(n))
for _ in range(runs):
    got = 0
    while got < n:
        got += c.recv_into(view[got:], n - got)
    c.sendall(b"k")
"""

_SEND = r"""
import socket, statistics, sys, time
ip, port, n, runs, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
c = socket.create_connection((ip, port))
data = memoryview(bytearray(b"\1" * n))
out = []
for i in range(warm + runs):
    t = time.perf_counter(); c.sendall(data); assert c.recv(1) == b"k"
    if i >= warm:
        out.append(time.perf_counter() - t)
print(n / 1e6 / statistics.median(out))
"""


def _in_ns(ns: str, code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, *args], text=True,
                            start_new_session=True, **kw)


def _raw_rtt(net, curve: bool) -> dict:
    import zmq

    host = net.hosts[0]
    spub, ssec = zmq.curve_keypair()
    p = _in_ns(net.netns(host), _ECHO, host, "1" if curve else "0", ssec.decode(), spub.decode(),
               stdout=subprocess.PIPE)
    ctx = zmq.Context()
    try:
        assert p.stdout is not None
        there = p.stdout.readline().strip()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        if curve:
            pull.curve_server, pull.curve_secretkey = True, ssec
            push.curve_serverkey = spub
            push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
        pull.bind(f"tcp://{net.controller_ip}:*")
        me = pull.getsockopt_string(zmq.LAST_ENDPOINT).encode()
        push.connect(there)
        msg = b"x" * 64

        def rt(_i):
            push.send_multipart([me, msg])
            pull.recv_multipart()

        return summary_us(time_calls(rt, 200, 2000))
    finally:
        p.kill()
        p.wait()
        ctx.destroy(0)


def _raw_tcp(net, runs: int = 16) -> float:
    a, b = net.hosts
    sink = _in_ns(net.netns(b), _SINK, b, str(NBYTES), str(runs + 2), stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        send = _in_ns(net.netns(a), _SEND, b, port, str(NBYTES), str(runs), "2", stdout=subprocess.PIPE)
        out, _ = send.communicate(timeout=120)
        return round(float(out), 1)
    finally:
        sink.kill()
        sink.wait()


def _death(job_factory, net, how: str) -> float:
    """Seconds from killing a host (``how``: "kill" its agent, "cut" its link) to the exception."""
    import psutil

    from monarch_kernel import ProcessDied

    from ._actors import Bench

    job = job_factory()
    try:
        procs = job.state().w.spawn_procs(per_host={"gpus": 1})
        mesh = procs.spawn("b", Bench)
        mesh.echo.call(0).get(timeout=30)
        host = net.hosts[1]
        pending = mesh.slice(hosts=1).sleep.call_one(60, os.devnull)
        time.sleep(0.3)
        t = time.perf_counter()
        if how == "cut":
            net.cut(host)
        else:
            for pid in net.pids(host):
                try:
                    if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                        os.kill(pid, signal.SIGKILL)
                except psutil.Error:
                    continue  # gone already, or a zombie
        try:
            pending.get(timeout=30)
        except ProcessDied:
            return round(time.perf_counter() - t, 2)
        raise AssertionError("the call on the dead host did not fail")
    finally:
        job.kill()
        net.restore(net.hosts[1])


def _same_host_calls(procs):
    """``call_one`` to rank 0 and ``call`` to all 4 of ``procs`` (4 ranks on this host), each a
    function of one argument, as ``time_calls`` wants."""
    from ._actors import Bench

    mesh = procs.spawn("b", Bench)
    one = mesh.slice(gpus=0)

    def call_one(i):
        assert one.echo.call_one(i).get() == i

    def call(i):
        assert len(mesh.echo.call(i).get()) == 4

    return call_one, call


def w9() -> dict:
    if os.geteuid() != 0:
        return {"W9_skipped": "needs root: network namespaces and sshd simulate the hosts"}
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support import cluster  # the tests' simulated hosts

    from monarch_kernel import this_host
    from monarch_kernel.job import SSHJob

    from ._actors import Bench, DataBench

    out: dict = {}
    with cluster.ssh_network() as net:
        def job_factory():
            job = SSHJob(python_exe=sys.executable, ssh_args=net.ssh_args)
            job.add_mesh("w", net.hosts)
            return job

        t = time.perf_counter()
        job = job_factory()
        try:
            procs = job.state().w.spawn_procs(per_host={"gpus": 2})
            mesh = procs.spawn("b", Bench)
            mesh.echo.call(0).get(timeout=60)
            out["W9_W1_ssh_2x2_first_answer_s"] = round(time.perf_counter() - t, 3)
            one = mesh.slice(hosts=1, gpus=0)

            def remote_one(i):
                assert one.echo.call_one(i).get() == i

            out["W9_W2_remote_call_one_us"] = summary_us(time_calls(remote_one, 200, 2000))
            four = job.state().w.spawn_procs(per_host={"gpus": 4}, name="four")
            m4 = four.spawn("b", Bench).slice(hosts=1)

            def remote_four(i):
                assert len(m4.echo.call(i).get()) == 4

            out["W9_W3_remote_n4_us"] = summary_us(time_calls(remote_four, 50, 500))
            owner = procs.slice(hosts=0, gpus=0).spawn("owner", DataBench)
            reader = procs.slice(hosts=1, gpus=0).spawn("reader", DataBench)
            buf = owner.register.call_one(NBYTES).get(timeout=60)
            used, samples = reader.read_times.call_one(buf, 2, 16).get(timeout=300)
            out["W9_W4b_between_hosts"] = {"transport": used,
                                           "MBps": round(NBYTES / 1e6 / statistics.median(samples), 1)}
        finally:
            job.kill()
        with this_host().spawn_procs(per_host={"gpus": 4}) as local:
            local_one, local_four = _same_host_calls(local)
            out["W9_W2_same_host_call_one_us"] = summary_us(time_calls(local_one, 200, 2000))
            out["W9_W3_same_host_n4_us"] = summary_us(time_calls(local_four, 50, 500))
        out["W9_raw_pyzmq_rtt_between_namespaces_us"] = _raw_rtt(net, curve=False)
        out["W9_raw_pyzmq_rtt_between_namespaces_curve_us"] = _raw_rtt(net, curve=True)
        out["W9_raw_tcp_between_namespaces_64MiB_MBps"] = _raw_tcp(net)
        out["W9_W5x_agent_killed_to_exception_s"] = _death(job_factory, net, "kill")
        out["W9_W5x_link_cut_to_exception_s"] = _death(job_factory, net, "cut")
    r = out
    r["W9_W2_ratio_remote_to_same_host"] = round(r["W9_W2_remote_call_one_us"]["median"]
                                                 / r["W9_W2_same_host_call_one_us"]["median"], 2)
    r["W9_W3_ratio_remote_to_same_host"] = round(r["W9_W3_remote_n4_us"]["median"]
                                                 / r["W9_W3_same_host_n4_us"]["median"], 2)
    r["W9_W4b_share_of_raw_tcp"] = round(r["W9_W4b_between_hosts"]["MBps"]
                                         / r["W9_raw_tcp_between_namespaces_64MiB_MBps"], 2)
    log(f"W9: {out}")
    return out


# ------------------------------------------------------------ W9jump: through a login host

_ROUTER_ECHO = r"""
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER)
s.bind(f"tcp://{sys.argv[1]}:*")
print(s.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
while True:
    s.send_multipart(s.recv_multipart())
"""


def _ssh_forward(ctl: str, host: str, op: str, spec: list[str]) -> None:
    subprocess.run(["ssh", "-S", ctl, "-O", op, *spec, host], check=True, capture_output=True, timeout=15,
                   stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def _hop_echo(net, ctl: str, alias: str, ip: str, sock: str):
    """The floor: a raw pyzmq DEALER/ROUTER round trip (16 B, as floors.py's) to an echo on the
    far host, through one ``-L`` forward of the same ssh connection that carries the mesh;
    yields the round trip, a function of one (ignored) argument, as ``time_calls`` wants."""
    import zmq

    p = _in_ns(net.netns(ip), _ROUTER_ECHO, ip, stdout=subprocess.PIPE)
    ctx = zmq.Context()
    spec = ["-L", f"{sock}:{ip}:0"]
    try:
        assert p.stdout is not None
        spec = ["-L", f"{sock}:{ip}:{p.stdout.readline().strip().rsplit(':', 1)[1]}"]
        _ssh_forward(ctl, alias, "forward", spec)
        s = ctx.socket(zmq.DEALER)
        s.connect(f"ipc://{sock}")
        msg = b"x" * 16

        def rt(_i):
            s.send(msg)
            s.recv()

        yield rt
    finally:
        subprocess.run(["ssh", "-S", ctl, "-O", "cancel", *spec, alias], capture_output=True, timeout=15,
                       stdin=subprocess.DEVNULL)
        p.kill()
        p.wait()
        ctx.destroy(0)


def _interleaved(fns: dict, warmup: int, timed: int, blocks: int = 10) -> dict:
    """Each of ``fns`` timed in turn, a block at a time (``timed`` calls each in all), so a
    load that comes and goes on the machine weighs on the runtime and its floor alike."""
    samples: dict = {name: [] for name in fns}
    for fn in fns.values():
        time_calls(fn, warmup, 0)
    for _ in range(blocks):
        for name, fn in fns.items():
            samples[name] += time_calls(fn, 0, timed // blocks)
    return {name: summary_us(got) for name, got in samples.items()}


def _two_way_rtt(net, ctl: str, alias: str, ip: str, sock: str, curve: bool) -> dict:
    """The runtime's own shape, raw: PUSH to the far host through ``-L``, its PUSH back to the
    controller's loopback through ``-R`` (each way its own forwarded connection), 64 B."""
    import zmq

    spub, ssec = zmq.curve_keypair()
    p = _in_ns(net.netns(ip), _ECHO, ip, "1" if curve else "0", ssec.decode(), spub.decode(), stdout=subprocess.PIPE)
    ctx = zmq.Context()
    specs: list[list[str]] = []
    try:
        assert p.stdout is not None
        there = p.stdout.readline().strip().rsplit(":", 1)[1]
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        if curve:
            pull.curve_server, pull.curve_secretkey = True, ssec
            push.curve_serverkey = spub
            push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
        pull.bind("tcp://127.0.0.1:*")
        me = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        port = me.rsplit(":", 1)[1]
        for spec in (["-R", f"127.0.0.1:{port}:127.0.0.1:{port}"], ["-L", f"{sock}:{ip}:{there}"]):
            _ssh_forward(ctl, alias, "forward", spec)
            specs.append(spec)
        push.connect(f"ipc://{sock}")
        msg = b"x" * 64

        def rt(_i):
            push.send_multipart([me.encode(), msg])
            pull.recv_multipart()

        return summary_us(time_calls(rt, 200, 2000))
    finally:
        for spec in specs:
            subprocess.run(["ssh", "-S", ctl, "-O", "cancel", *spec, alias], capture_output=True, timeout=15,
                           stdin=subprocess.DEVNULL)
        p.kill()
        p.wait()
        ctx.destroy(0)


def _jump_config(net, path: str, login: str, far: str) -> None:
    with open(path, "w") as f:
        f.write(f"Host login\n  HostName {login}\nHost far\n  HostName {far}\n  ProxyJump login\n"
                f"Host *\n  User {net.user}\n  IdentityFile {net.key}\n  IdentitiesOnly yes\n  IdentityAgent none\n"
                "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n"
                "  ConnectTimeout 5\n")


def w9_jump() -> dict:
    """``call_one`` and ``call`` (4 ranks) on a host reached through a login host with
    ``out_of_cluster=True`` (it has no route to the controller), beside the raw round trip
    over a forward of the same ssh connection (the floor), the runtime's two-forward shape, and
    the same two calls on this host (what the call's fan-out to 4 ranks costs without ssh)."""
    if os.geteuid() != 0:
        return {"W9jump_skipped": "needs root: network namespaces and sshd simulate the hosts"}
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support import cluster

    from monarch_kernel import this_host
    from monarch_kernel.job import SSHJob

    from ._actors import Bench

    out: dict = {}
    tmp = tempfile.mkdtemp(prefix="mkbench-jump-")
    python = os.path.join(tmp, "python")  # the hosts run this checkout, as the controller does
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexport PYTHONPATH={ROOT}${{PYTHONPATH:+:$PYTHONPATH}}\nexec {sys.executable} "$@"\n')
    os.chmod(python, 0o755)
    with cluster.ssh_network(2) as net:
        login, far = net.hosts
        ns = net.netns(far)
        cluster.run(["ip", "-n", ns, "route", "del", "default"])
        cluster.run(["ip", "-n", ns, "route", "add", "prohibit", f"{net.controller_ip}/32"])
        cfg = os.path.join(tmp, "ssh_config")
        _jump_config(net, cfg, login, far)
        t = time.perf_counter()
        job = SSHJob(python_exe=python, ssh_args=("-F", cfg), out_of_cluster=True)
        job.add_mesh("w", ["far"])
        try:
            mesh = job.state().w.spawn_procs(per_host={"gpus": 4}).spawn("b", Bench)
            mesh.echo.call(0).get(timeout=60)
            out["W9jump_W1_first_answer_s"] = round(time.perf_counter() - t, 3)
            one = mesh.slice(gpus=0)

            def call_one(i):
                assert one.echo.call_one(i).get() == i

            two = mesh.slice(gpus=slice(0, 2))

            def call(i):
                assert len(mesh.echo.call(i).get()) == 4

            def call_two(i):
                assert len(two.echo.call(i).get()) == 2

            ctl = job.control_socket("far")
            assert ctl, "an out-of-cluster host has an ssh control socket"
            with _hop_echo(net, ctl, "far", far, os.path.join(tmp, "hop")) as hop:
                got = _interleaved({"call_one": call_one, "floor": hop}, 200, 2000)
                out["W9jump_call_one_us"], out["W9jump_floor_hop_rtt_us"] = got["call_one"], got["floor"]
                got = _interleaved({"call": call, "call_two": call_two, "floor": hop}, 50, 500)
                out["W9jump_call_n4_us"], out["W9jump_floor_hop_rtt_beside_n4_us"] = got["call"], got["floor"]
                out["W9jump_call_n2_us"] = got["call_two"]  # one level forwarded on the host, one rank there
            out["W9jump_raw_push_pull_L_R_us"] = _two_way_rtt(net, ctl, "far", far, os.path.join(tmp, "two"), False)
            out["W9jump_raw_push_pull_L_R_curve_us"] = _two_way_rtt(net, ctl, "far", far, os.path.join(tmp, "twoc"),
                                                                    True)
        finally:
            job.kill()
            shutil.rmtree(tmp, ignore_errors=True)
    with this_host().spawn_procs(per_host={"gpus": 4}) as local:  # what the fan-out to 4 ranks costs alone
        local_one, local_four = _same_host_calls(local)
        got = _interleaved({"call_one": local_one, "n4": local_four}, 100, 1000)
        out["W9jump_same_host_call_one_us"], out["W9jump_same_host_n4_us"] = got["call_one"], got["n4"]
    floor = out["W9jump_floor_hop_rtt_us"]["median"]
    out["W9jump_call_one_over_hop_floor"] = round(out["W9jump_call_one_us"]["median"] / floor, 2)
    out["W9jump_call_n4_over_hop_floor"] = round(out["W9jump_call_n4_us"]["median"]
                                                  / out["W9jump_floor_hop_rtt_beside_n4_us"]["median"], 2)
    log(f"W9jump: {out}")
    return out
