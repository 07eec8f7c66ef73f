"""Ranks on other hosts: SSHJob over simulated hosts (network namespaces, each with its own
sshd; see cluster.py).  Calls, the multicast tree and RDMABuffer reads cross hosts; a host
that dies (its agent killed, its link cut) fails its ranks' calls with ProcessDied naming it,
within seconds; under a restart policy its ranks restart on the other host, where every
reference reaches them; start failures say what to fix; a wrong Curve key is refused and
counted; nothing is left on any host (the fixture checks every namespace after each test)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import psutil
import pytest
import zmq
from support.actors import wait_until
from support.config import configured

from monarch_kernel import Actor, ProcessDied, RDMABuffer, endpoint, this_host
from monarch_kernel.job import SSHJob, job_load
from monarch_kernel.runtime.context import current_actor
from monarch_kernel.runtime.process import Runtime
from monarch_kernel.spmd import setup_torch_distributed

pytestmark = pytest.mark.timeout(120)
# What a script that imports this module puts on sys.path: its folder, and tests/ (the helpers).
SCRIPT_PATH = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


class Where(Actor):
    @endpoint
    def where(self) -> tuple:
        return os.getpid(), os.environ.get("MONARCH_KERNEL_BIND"), os.stat("/proc/self/ns/net").st_ino

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    @endpoint
    def ask(self, other, x):
        """Call another actor mesh (on another host) from this rank."""
        return list(other.echo.call(x).get(timeout=30).values())

    @endpoint
    def keep(self, other) -> None:
        """Hold a reference to another actor mesh, to call later (``ask_kept``)."""
        self.kept = other

    @endpoint
    def ask_kept(self, x):
        return list(self.kept.echo.call(x).get(timeout=30).values())

    @endpoint
    def own_ref(self) -> tuple:
        """What this rank's own ``ActorContext.mesh`` says of its mesh."""
        ref = current_actor.get().mesh
        return ref.addresses, ref.hosts

    @endpoint
    def say(self, line: str) -> None:
        print(line, flush=True)

    @endpoint
    def talk(self, n: int, tag: str) -> int:
        for i in range(n):
            print(f"{tag} {i}")
        print(f"{tag} done", flush=True)
        return n


class Buffers(Actor):
    def __init__(self):
        self.kept = {}

    @endpoint
    def make(self, n: int) -> tuple:
        data = bytearray(os.urandom(n))
        self.kept["b"] = data
        return RDMABuffer(memoryview(data)), zlib.crc32(data)

    @endpoint
    def read(self, buf: RDMABuffer) -> tuple:
        dst = bytearray(buf.size)
        buf.read_into(memoryview(dst)).get(timeout=60)
        return buf.transport(), zlib.crc32(dst)


@pytest.fixture(scope="module")
def checkout_python(tmp_path_factory) -> str:
    """The interpreter, with this checkout first on its path: agents started over ssh (in the
    remote home, without our PYTHONPATH) then run the code under test, not an installed copy."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = tmp_path_factory.mktemp("python") / "python"
    path.write_text(f'#!/bin/sh\nexport PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def job(ssh_hosts, checkout_python):
    job = SSHJob(python_exe=checkout_python, ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts)
    yield job
    job.kill()


def test_two_hosts_answer_and_the_tree_crosses_them(job, ssh_hosts):
    started = time.monotonic()
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("where", Where)
    got = m.where.call().get(timeout=30)
    first = time.monotonic() - started
    assert procs.extent == {"hosts": 2, "gpus": 2}
    binds = [got[{"hosts": h, "gpus": g}][1] for h in range(2) for g in range(2)]
    assert binds == [ssh_hosts.hosts[0]] * 2 + [ssh_hosts.hosts[1]] * 2  # each rank listens on its host's address
    assert len({got[{"hosts": h, "gpus": 0}][2] for h in range(2)}) == 2  # two network namespaces
    assert procs.ref.hosts == tuple([ssh_hosts.hosts[0]] * 2 + [ssh_hosts.hosts[1]] * 2)
    assert first < 30
    # Fan-out 1: the controller sends one message per call; the rest is forwarded rank to rank.
    rt = Runtime.current()
    old, rt.outbox.fanout = rt.outbox.fanout, 1
    try:
        counts = []
        for _ in range(3):  # the fewest of three: the agents' heartbeats are sent meanwhile too
            sent = rt.transport.sent
            assert list(m.echo.call(7).get(timeout=30).values()) == [7] * 4
            counts.append(rt.transport.sent - sent)
        assert min(counts) == 1
    finally:
        rt.outbox.fanout = old
    # A rank on host 1 calls the actors on host 0 directly.
    host0 = m.slice(hosts=0)
    assert m.slice(hosts=1, gpus=0).ask.call_one(host0, "x").get(timeout=30) == ["x", "x"]
    assert rt.stats()["dropped"]["curve"] == 0


def test_what_ranks_on_other_hosts_printed_before_answering_is_in_once_drained(job):
    """An answer overtakes the output its rank wrote before it (they travel apart): once
    ``drain_output`` returns, every host's agent has had its template read its ranks' pipes
    dry and sent it, so all of it has reached the output hooks (a notebook cell waits so at
    its end).  Host 1's template is stopped while its ranks print and answer, and goes on
    only after the drain was asked."""
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("where", Where)
    template = psutil.Process(m.slice(hosts=1, gpus=0).where.call_one().get(timeout=30)[0]).parent()
    lines: list = []
    sink = Runtime.current().hooks.output.install(lambda mesh, rank, stream, line: lines.append((rank, line)))
    try:
        for tag in ("a", "b"):
            template.suspend()
            try:
                assert list(m.talk.call(100, tag).get(timeout=60).values()) == [100] * 4
                assert not any(line == f"{tag} done" for r, line in lines if r >= 2)  # held in host 1's pipes
            finally:
                threading.Timer(0.5, template.resume).start()
            assert Runtime.current().drain_output(30)
            seen = [(r, line) for r, line in lines if line.startswith(tag + " ")]
            assert {(r, f"{tag} done") for r in range(4)} <= set(seen), (tag, len(seen), seen[-4:])
            assert len(seen) == 4 * 101
    finally:
        template.resume()
        sink.remove()


def test_rdma_buffer_read_between_hosts(job):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
    b = procs.spawn("buffers", Buffers)
    buf, expect = b.slice(hosts=0).make.call_one(8 << 20).get(timeout=30)
    assert b.slice(hosts=1).read.call_one(buf).get(timeout=60) == ("tcp", expect)


def _agent_pid(ssh_hosts, host: str) -> int:
    for pid in ssh_hosts.pids(host):
        try:
            if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no agent on {host}")


def test_a_killed_agent_fails_its_hosts_calls_and_spares_the_other(job, ssh_hosts):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("where", Where)
    m.echo.call(0).get(timeout=30)
    pending = m.slice(hosts=0).nap.call(30)
    time.sleep(0.3)
    os.kill(_agent_pid(ssh_hosts, ssh_hosts.hosts[0]), signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(ProcessDied, match=ssh_hosts.hosts[0].replace(".", r"\.")):
        pending.get(timeout=20)
    assert time.monotonic() - t < 5
    assert list(m.slice(hosts=1).echo.call(1).get(timeout=30).values()) == [1, 1]


def test_a_cut_link_fails_the_hosts_calls_within_seconds(job, ssh_hosts):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
    m = procs.spawn("where", Where)
    m.echo.call(0).get(timeout=30)
    pending = m.slice(hosts=1).nap.call(30)
    time.sleep(0.3)
    ssh_hosts.cut(ssh_hosts.hosts[1])
    t = time.monotonic()
    with pytest.raises(ProcessDied) as e:
        pending.get(timeout=30)
    waited = time.monotonic() - t
    assert ssh_hosts.hosts[1] in str(e.value) and "silent" in str(e.value)
    assert waited < 8  # 3 s of silence, plus a beat, on a busy machine
    assert m.slice(hosts=0).echo.call_one(2).get(timeout=30) == 2
    ssh_hosts.restore(ssh_hosts.hosts[1])  # its agent has heard nothing either: it ends itself and its ranks


def test_start_failures_say_what_to_fix(ssh_hosts):
    host = ssh_hosts.hosts[0]
    t = time.monotonic()
    bad_key = SSHJob(python_exe=sys.executable, ssh_args=ssh_hosts.ssh_args_for(ssh_hosts.wrong_key))
    bad_key.add_mesh("m", [host])
    with pytest.raises(ConnectionError, match="ssh authentication failed"):
        bad_key.state()
    assert time.monotonic() - t < 15
    no_python = SSHJob(python_exe="/nonexistent/python3", ssh_args=ssh_hosts.ssh_args)
    no_python.add_mesh("m", [host])
    with pytest.raises(ConnectionError, match="was not found on"):
        no_python.state()
    system = "/usr/bin/python3"
    if subprocess.run([system, "-c", "import monarch_kernel"], capture_output=True).returncode == 0:
        pytest.skip(f"{system} has monarch_kernel installed, so it cannot stand for a host without it")
    no_module = SSHJob(python_exe=system, ssh_args=ssh_hosts.ssh_args)
    no_module.add_mesh("m", [host])
    with pytest.raises(ConnectionError, match=r"monarch_kernel is not installed .*pip install"):
        no_module.state()


def test_a_wrong_curve_key_is_refused_and_counted(job):
    job.state()  # the controller now listens for the job's hosts
    rt = Runtime.current()
    at_start = rt.stats()["dropped"]
    before = at_start["curve"]
    assert rt.network.curve is not None and rt.network.net_address is not None
    ctx = zmq.Context.instance()
    intruder = ctx.socket(zmq.PUSH)
    public, secret = zmq.curve_keypair()  # the server's key is public; the job's client key is not
    intruder.curve_serverkey = rt.network.curve.server_public
    intruder.curve_publickey, intruder.curve_secretkey = public, secret
    intruder.connect(rt.network.net_address)
    intruder.send_multipart([b"x" * 32, b"not a header"], zmq.NOBLOCK)
    deadline = time.monotonic() + 10
    while rt.stats()["dropped"]["curve"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    intruder.close(linger=0)
    assert rt.stats()["dropped"]["curve"] > before
    after = rt.stats()["dropped"]
    assert (after["malformed"], after["unsigned"]) == (at_start["malformed"], at_start["unsigned"])  # nothing read


def test_job_load_reconnects_from_another_process_and_controller_death_leaves_nothing(job, ssh_hosts, tmp_path):
    job.state()
    path = str(tmp_path / "job.json")
    job.dump(path)
    with open(path) as f:
        assert "key" not in f.read()
    script = tmp_path / "second.py"
    script.write_text(textwrap.dedent(f'''
        import os, sys, time
        sys.path[:0] = {SCRIPT_PATH!r}
        from monarch_kernel.job import job_load
        from test_hosts import Where
        job = job_load({path!r})
        procs = job.state().workers.spawn_procs(per_host={{"gpus": 1}})
        print(sorted(v[1] for v in procs.spawn("w", Where).where.call().get(timeout=30).values()), flush=True)
        print("ready", flush=True)
        time.sleep(60)
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == str(sorted(ssh_hosts.hosts)), line
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()  # the second controller dies without cleaning up: its agents and ranks must follow
        proc.wait(10)
        proc.stdout.close()
    assert job_load(path).kind == "ssh"


class Importer(Actor):
    @endpoint
    def call(self, module: str, fn: str):
        import importlib

        mod = importlib.import_module(module)
        return getattr(mod, fn)(), mod.__file__


def test_sync_workspace_makes_an_edited_module_callable_on_remote_ranks(job, tmp_path):
    src = tmp_path / "proj"
    src.mkdir()
    (src / "remote_mod.py").write_text("def f():\n    return 'f1'\n")
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
    first = procs.sync_workspace(str(src))
    assert first.files_sent >= 1
    imp = procs.spawn("importer", Importer)
    got = imp.call.call("remote_mod", "f").get(timeout=30)
    assert [v[0] for v in got.values()] == ["f1", "f1"]
    assert all(not v[1].startswith(str(src)) for v in got.values())  # imported from the host's per-job copy
    (src / "remote_mod.py").write_text("def f():\n    return 'f2'\n\ndef g():\n    return 'g'\n")
    second = procs.sync_workspace(str(src))
    assert second.files_sent >= 1
    assert [v[0] for v in imp.call.call("remote_mod", "g").get(timeout=30).values()] == ["g", "g"]
    assert procs.sync_workspace(str(src)).files_sent == 0


class Dies(Actor):
    @endpoint
    def die(self) -> None:
        os._exit(7)

    @endpoint
    def ping(self) -> int:
        return os.getpid()


def test_a_dead_remote_rank_restarts_on_its_own_host(job, ssh_hosts):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
    d = procs.spawn("dies", Dies)
    old = d.slice(hosts=1).ping.call_one().get(timeout=30)
    with pytest.raises(ProcessDied, match="exited with code 7"):
        d.slice(hosts=1).die.call_one().get(timeout=30)
    procs.restart([1], [(d, Dies, (), {})])
    new = d.slice(hosts=1).ping.call_one().get(timeout=30)
    assert new != old and new in ssh_hosts.pids(ssh_hosts.hosts[1])  # a fresh process, on the same host


def test_stacks_and_usage_of_ranks_on_other_hosts_are_read_by_their_agents(job):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
    m = procs.spawn("where", Where)
    m.slice(hosts=1).nap.call_one(60)  # one rank busy, the other idle

    def napping():
        r = procs.stacks(method="py-spy")
        busy = any(f.name.endswith("nap") for t in r.stacks[1].threads for f in t.frames)
        return r if busy and r.summary()[-1] == "[rank 0] idle: no user code running" else None  # (imports done)

    deadline = time.monotonic() + 60
    while (report := napping()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report is not None, procs.stacks()
    assert [s.method for s in report.stacks] == ["py-spy", "py-spy"]  # run by each host's agent
    assert [s.host for s in report.stacks] == list(procs.ref.hosts)
    assert report.summary()[0].startswith("[rank 1] Where.nap (test_hosts.py:")
    assert report.summary()[1] == "[rank 0] idle: no user code running"  # a tie: the idle group goes last
    # %mesh top's and the panel's samples: each host's agent reads its ranks' /proc.
    from monarch_kernel.observe.metrics import RankMetrics

    metrics = RankMetrics()
    metrics.sample(procs)
    second = metrics.sample(procs)
    assert all(p.rss_mib and p.rss_mib > 10 for p in second.values()), second
    assert all(p.cpu is not None for p in second.values()), second


def test_an_agent_that_never_connects_fails_the_start_in_time(ssh_hosts, tmp_path):
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")  # starts, reads nothing, never connects back
    silent.chmod(0o755)
    job = SSHJob(python_exe=str(silent), ssh_args=ssh_hosts.ssh_args, start_timeout=3)
    job.add_mesh("m", [ssh_hosts.hosts[0]])
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"agent on {ssh_hosts.hosts[0]} did not connect back in time"):
        job.state()
    assert time.monotonic() - t < 15


def test_a_host_without_room_refuses_the_spawn_before_anything_is_forked(job, ssh_hosts):
    """Each host checks its own memory and process limits when the controller asks it for
    ports: with a rank said to cost 1 PiB no host has room, and the spawn is refused, naming
    the host, before any host forks a rank; check_limits=False spawns them anyway."""
    hosts = job.state().workers
    on_hosts = {h: set(ssh_hosts.pids(h)) for h in ssh_hosts.hosts}  # each one's agent and template
    with pytest.raises(ValueError, match="per_host names a dim 'hosts', which a job's mesh has already"):
        hosts.spawn_procs(per_host={"hosts": 2})
    with configured(rank_memory=1 << 50):
        with pytest.raises(ValueError) as info:
            hosts.spawn_procs(per_host={"gpus": 2})
        text = str(info.value)
        assert text.startswith("spawn_procs(per_host={'gpus': 2}) refused before starting anything: an idle rank "
                               "takes about 1,024 TiB (MONARCH_KERNEL_RANK_MEMORY), so 2 ranks need 2,048 TiB"), text
        assert any(f"So {h} has room for 0 more ranks per host, not 2.  If you know better, spawn_procs(..., "
                   f"check_limits=False)" in text for h in ssh_hosts.hosts), text
        assert {h: set(ssh_hosts.pids(h)) for h in ssh_hosts.hosts} == on_hosts, "a host started a process"
        procs = hosts.spawn_procs(per_host={"gpus": 1}, check_limits=False)
        assert list(procs.spawn("where", Where).echo.call(3).get(timeout=30).values()) == [3, 3]


class Gloo(Actor):
    @endpoint
    def all_reduce(self) -> tuple:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), os.environ["MASTER_ADDR"],
                t.item())


@pytest.mark.timeout(180)
def test_torch_distributed_spans_two_hosts(job, ssh_hosts):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    assert setup_torch_distributed(procs, "gloo") == "gloo"
    got = sorted(procs.spawn("gloo", Gloo).all_reduce.call().get(timeout=120).values())
    assert [g[:3] for g in got] == [(0, 4, 0), (1, 4, 1), (2, 4, 0), (3, 4, 1)]  # LOCAL_RANK counts per host
    assert {g[3] for g in got} == {ssh_hosts.hosts[0]}  # rank 0's address on its host, reachable from the other
    assert {g[4] for g in got} == {6.0}


def _restarted(procs, ranks: set, kind: str = "restart") -> list:
    """The restart events of ``procs`` until they cover ``ranks`` (a host's ranks may be
    replaced in one batch or several)."""
    events: list = []
    while not set().union(*(e.ranks for e in events)) >= ranks:
        events.append(procs.wait_restart(after=len(events), timeout=60))
        assert events[-1].kind == kind, events[-1]
    return events


def test_ranks_whose_host_is_gone_restart_on_another_host_and_every_reference_reaches_them(job, ssh_hosts):
    """The restart policy on: host 0's agent SIGKILLed, its two ranks come back on host 1 (its
    network namespace, its address), say so in their restart events, answer the mesh's calls,
    print through host 1's agent, and a rank that was handed a reference to them before the
    move reaches them through it, as does a reference pickled in the controller before."""
    a, b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2}, restart="on-failure")
    m = procs.spawn("where", Where)
    ns_b = m.slice(hosts=1, gpus=0).where.call_one().get(timeout=30)[2]
    asker = m.slice(hosts=1, gpus=0)
    asker.keep.call_one(m.slice(hosts=0)).get(timeout=30)
    assert asker.ask_kept.call_one("before").get(timeout=30) == ["before", "before"]  # it knows their actors now
    pickled = pickle.dumps(m.slice(hosts=0))
    old = procs.ref
    lines: list = []
    sink = Runtime.current().hooks.output.install(lambda mesh, rank, stream, line: lines.append((rank, line)))
    try:
        os.kill(_agent_pid(ssh_hosts, a), signal.SIGKILL)
        events = _restarted(procs, {0, 1})
        for e in events:
            assert set(e.hosts) == {b} and set(e.moved_from) == {a}, e
            assert f"moved from {a} (gone) to {b}" in e.line(), e.line()
        got = m.where.call().get(timeout=30)
        assert {v[2] for v in got.values()} == {ns_b}  # every rank in host 1's network namespace
        assert {v[1] for v in got.values()} == {b}
        assert [v[0] for v in got.values()][:2] != [v[0] for v in got.values()][2:]
        assert procs.ref.hosts == (b,) * 4 and [row["host"] for row in procs.rank_states()] == [b] * 4
        assert all(x.startswith(f"tcp://{b}:") for x in procs.ref.addresses)
        assert procs.ref.addresses[2:] == old.addresses[2:] and procs.ref.addresses[:2] != old.addresses[:2]
        # Every rank's own mesh reference names where the moved ones are now, theirs and the survivors'.
        refs = m.own_ref.call().get(timeout=30).values()
        assert all((tuple(x), tuple(h)) == (procs.ref.addresses, (b,) * 4) for x, h in refs), refs
        # References made before the move reach the moved ranks: one held by a rank, one pickled here.
        assert asker.ask_kept.call_one("after").get(timeout=30) == ["after", "after"]
        assert list(pickle.loads(pickled).echo.call("again").get(timeout=30).values()) == ["again"] * 2
        # A rank forked after the move, handed a reference made before it, reaches them too.
        with this_host().spawn_procs(per_host={"r": 1}) as local:
            assert local.spawn("w", Where).ask.call_one(pickle.loads(pickled), "new").get(timeout=30) == ["new"] * 2
        # A moved rank's output comes through its new host's agent.
        m.slice(hosts=0, gpus=0).say.call_one("hello from the moved rank").get(timeout=30)
        wait_until(lambda: (0, "hello from the moved rank") in lines, 30, "the moved rank's line")
        # Once the mesh ends its forwards go: host 0 will reuse those ports for other processes.
        rt = Runtime.current()
        assert set(old.addresses[:2]) <= set(rt.outbox.forwards())
        procs.stop().get(timeout=30)
        wait_until(lambda: not set(old.addresses[:2]) & set(rt.outbox.forwards()), 30, "the ended mesh's forwards gone")
    finally:
        sink.remove()


def test_a_port_a_moved_rank_left_taken_by_a_live_actor_gets_that_actors_calls(job, ssh_hosts):
    """Ports are reused: a rank that moved away from port P of a host (its mesh ended since)
    left a forward P -> its new home, and an actor of a later mesh listening on P there must
    still get its calls, not have them forwarded to a process long gone (the chaos run's
    last hangs: a rebuilt job's actor answered nothing, idle, while its calls waited for
    ever).  Both orders: the move heard after the actor answered from P, and before."""
    a, _b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    m = procs.spawn("where", Where)
    assert list(m.echo.call(1).get(timeout=30).values()) == [1] * 4
    rt = Runtime.current()
    route = next(k for k in rt.outbox.direct if k[0] == procs.ref.id and k[1] == 2)  # host 1's first rank's actor
    port = rt.outbox.direct[route]
    gone = f"tcp://{a}:9"  # where the ended mesh's rank moved: nothing listens there now
    target = m.slice(hosts=1, gpus=0)
    # The move is heard after the actor answered from that port: no forward is made.
    rt.outbox.rank_moved("m-ended-1", 0, port, gone)
    assert port not in rt.outbox.forwards()
    assert target.echo.call_one(2).get(timeout=15) == 2
    # The move was heard before the actor's first answer (its route not learnt yet): the answer
    # names the port, and the forward from it goes.
    del rt.outbox.direct[route]
    rt.transport.forward(port, gone, "m-ended-2")
    assert target.echo.call_one(3).get(timeout=15) == 3  # through the rank's main inbox; its answer names the port
    assert port not in rt.outbox.forwards() and rt.outbox.direct.get(route) == port
    assert target.echo.call_one(4).get(timeout=15) == 4  # straight to the port, as before


@pytest.mark.timeout(240)
def test_late_answers_of_moved_ranks_former_processes_do_not_misdirect_their_calls(job, ssh_hosts):
    """The restart policy on: host 0's link is cut while its ranks nap, and they move to host 1.
    Their former processes answered into the cut; when the link comes back those answers arrive
    late, naming the actors' old inboxes on host 0.  They must not be learnt: every later call
    reaches the moved ranks (it once went to the old inbox and waited for ever)."""
    a, b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 2}, restart="on-failure")
    m = procs.spawn("where", Where)
    assert list(m.echo.call(0).get(timeout=30).values()) == [0] * 4  # every actor's own inbox learnt
    napping = m.slice(hosts=0).nap.call(2.0)
    time.sleep(0.3)
    ssh_hosts.cut(a)
    with pytest.raises(ProcessDied):
        napping.get(timeout=30)
    _restarted(procs, {0, 1})
    ssh_hosts.restore(a)
    # The late answers go to this thread's inbox, read while it waits for host 1's answers (which
    # teach nothing of host 0's actors); its next call to a moved rank follows what it learnt.
    stayed, moved = m.slice(hosts=1), m.slice(hosts=0, gpus=0)
    until = time.monotonic() + 10
    i = 0
    while time.monotonic() < until:
        i += 1
        assert list(stayed.echo.call(i).get(timeout=30).values()) == [i] * 2
        assert moved.echo.call_one(i).get(timeout=20) == i
        time.sleep(0.2)
    assert {v[1] for v in m.where.call().get(timeout=30).values()} == {b}


def test_ranks_whose_host_is_gone_stay_dead_when_no_other_host_has_room(job, ssh_hosts):
    """The restart policy on, but no other host has room (each rank said to cost 1 PiB): host
    0's rank is not restarted, and the failed restart event says why; host 1's still answers."""
    a, b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
    m = procs.spawn("where", Where)
    m.echo.call(0).get(timeout=30)
    with configured(rank_memory=1 << 50):
        os.kill(_agent_pid(ssh_hosts, a), signal.SIGKILL)
        (event,) = _restarted(procs, {0}, kind="failed")
    assert f"ranks [0] of mesh '{procs.name}' cannot be restarted: their host {a} is gone" in event.error, event.error
    assert f"and no other host of the mesh has room for them: {b}: an idle rank takes about 1,024 TiB" \
        in event.error, event.error
    assert procs.ref.hosts == (a, b) and [row["state"] for row in procs.rank_states()][0] == "dead"
    assert m.slice(hosts=1).echo.call_one(1).get(timeout=30) == 1


def _train(steps: int, progress: str) -> dict:
    """A few DDP steps (gloo) under ``elastic_steps``; rank 0 writes ``step world`` to ``progress``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from monarch_kernel.spmd import elastic_steps

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp, done = DDP(model), []
    for step in elastic_steps(steps, model, opt, name="moved"):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * world + rank))
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        done.append(step + 1)
        if rank == 0:
            with open(progress + ".tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(progress + ".tmp", progress)
        time.sleep(0.05)
    return {"steps": done, "world": world, "params": [p.detach().tolist() for p in model.parameters()]}


@pytest.mark.timeout(240)
def test_elastic_run_goes_on_when_a_host_is_lost_its_rank_restarted_on_the_other(job, ssh_hosts, tmp_path):
    """Training with nobody watching (issue 44 point 3) through the loss of a whole host: host
    0's agent SIGKILLed mid-loop, its rank (the group's rank 0, whose store the group met at)
    is restarted on host 1, and the loop goes on at two ranks, to the last step."""
    from monarch_kernel.spmd import elastic_run

    a, b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
    progress = str(tmp_path / "step")
    killer = _kill_agent_at(ssh_hosts, a, progress, 10)
    run = elastic_run(procs, _train, 40, progress)
    killer.join(5)
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("replaced", (0,), 2)], run.changes
    assert run.members == (0, 1) and procs.ref.hosts == (b, b)
    assert [v["steps"][-1] for v in run.values.values()] == [40, 40] and run.values[0]["steps"][0] > 1
    assert run.values[0]["params"] == run.values[1]["params"]


@pytest.mark.timeout(240)
def test_elastic_run_goes_on_at_once_without_a_lost_hosts_rank_that_has_nowhere_to_go(job, ssh_hosts, tmp_path):
    """Shrink (issue 44 point 4): host 0's agent SIGKILLed mid-loop and no other host with room
    (each rank said to cost 1 PiB), so its rank cannot be replaced.  The policy's failed restart
    tells ``elastic_run``, which goes on with host 1's rank alone at once, not after its
    ``replace_timeout`` (60 s) of waiting for a replacement that cannot come."""
    from monarch_kernel.spmd import elastic_run

    a, _b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
    progress = str(tmp_path / "step")
    with configured(rank_memory=1 << 50):
        killer = _kill_agent_at(ssh_hosts, a, progress, 10)
        run = elastic_run(procs, _train, 40, progress)
        killer.join(5)
    assert [(c.kind, c.ranks, c.world_size) for c in run.changes] == [("shrunk", (0,), 1)], run.changes
    assert run.changes[0].seconds < 30, run.changes  # the failed restart, not the 60 s timeout
    assert run.members == (1,) and run.values[1]["steps"][-1] == 40 and run.values[1]["world"] == 1
    assert procs.events()[-1].kind == "failed"


def _kill_agent_at(ssh_hosts, host: str, progress: str, step: int) -> threading.Thread:
    """A thread that SIGKILLs ``host``'s agent once rank 0 wrote ``step`` to ``progress``."""

    def kill_at() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), open(progress) as f:
                if int(f.read()) >= step:
                    os.kill(_agent_pid(ssh_hosts, host), signal.SIGKILL)
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_at, daemon=True)
    killer.start()
    return killer


class Torchrun(Actor):
    @endpoint
    def env(self) -> tuple:
        """torchrun's local variables here, and a sum over the default group."""
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), int(t.item())


@pytest.mark.timeout(180)
def test_a_group_set_up_again_after_a_rank_moved_counts_the_hosts_ranks_anew(job, ssh_hosts):
    """A rank moved to the other host (its own gone) shares that host with the rank there:
    setting the group up again gives them LOCAL_RANK 0 and 1 of LOCAL_WORLD_SIZE 2 (a GPU
    each), not what they had on hosts of their own, and the group works."""
    a, _b = ssh_hosts.hosts
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
    t = procs.spawn("torchrun", Torchrun)
    setup_torch_distributed(procs, "gloo")
    assert sorted(t.env.call().get(timeout=60).values()) == [(0, 1, 2), (0, 1, 2)]
    os.kill(_agent_pid(ssh_hosts, a), signal.SIGKILL)
    _restarted(procs, {0})
    setup_torch_distributed(procs, "gloo")
    assert sorted(t.env.call().get(timeout=60).values()) == [(0, 2, 2), (1, 2, 2)]
