"""Workers that any scheduler starts (``python -m monarch_kernel.agent --listen ... --key-file
...``) and the controllers that attach to them (``attach_to_workers``, ``%mesh spawn --attach``).

Real worker processes on 127.0.0.1 and one in a network namespace joined by a veth pair (a
host of its own); controllers that are this process, a script, or a real kernel.  A worker
outlives its controller and serves the next one; a wrong key is refused before anything but
the 48 bytes of the handshake is read, and the worker keeps serving; a flood of connections
that never prove the key is bounded; a killed worker fails its ranks' calls with
``ProcessDied`` naming it.  Every test ends the workers it started and waits for them."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import psutil
import pytest
from support.cluster import veth_namespace
from support.kernels import assert_gone, running

from monarch_kernel import Actor, ProcessDied, attach_to_workers, endpoint, run_worker_loop_forever
from monarch_kernel.agent import worker_wire
from monarch_kernel.agent.worker import MAX_UNAUTHENTICATED_PER_PEER
from monarch_kernel.agent.worker_key import KeyFileError, new_key_file
from monarch_kernel.job import AttachJob, job_load

pytestmark = pytest.mark.timeout(120)
# What a script that imports this module puts on sys.path: its folder, and tests/ (the helpers).
SCRIPT_PATH = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


class Where(Actor):
    @endpoint
    def where(self) -> tuple:
        return os.getpid(), os.stat("/proc/self/ns/net").st_ino

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"

    @endpoint
    def env(self, name: str):
        return os.environ.get(name)


class Worker:
    """A worker process (``argv`` before python: e.g. ``ip netns exec NS``); its stderr lines
    are collected as they come."""

    def __init__(self, key: str, ip: str = "127.0.0.1", prefix: tuple = (), python: tuple = (sys.executable,)):
        self.proc = subprocess.Popen([*prefix, *python, "-m", "monarch_kernel.agent", "--listen",
                                      f"tcp://{ip}:0", "--key-file", key], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        found = self.wait_for(r"listening on (tcp://\S+) \(pid (\d+)\)")
        self.address, self.pid = found[1], int(found[2])

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 30, after: int = 0) -> re.Match:
        """The first line (from the ``after``-th on) matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines[after:]:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"the worker exited ({self.proc.returncode}) before saying {pattern!r}:\n"
                                     + self.log())
            assert time.monotonic() < deadline, f"timed out waiting for the worker to say {pattern!r}:\n{self.log()}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def key(tmp_path) -> str:
    return new_key_file(str(tmp_path / "worker.key"))


@pytest.fixture
def workers(key):
    """Start workers with ``workers(n)``; every one is stopped after the test."""
    started: list[Worker] = []

    def start(n: int = 1, **kw) -> list[Worker]:
        for _ in range(n):
            started.append(Worker(kw.get("key", key), **{k: v for k, v in kw.items() if k != "key"}))
        return started[-n:]

    yield start
    for w in started:
        w.stop()


# ---------------------------------------------------------------- the key file


def test_key_new_writes_a_private_key_and_a_readable_one_is_refused(tmp_path):
    path = tmp_path / "k"
    out = subprocess.run([sys.executable, "-m", "monarch_kernel", "key", "new", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and f"wrote a new key to {path} (mode 0600)" in out.stdout, out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "monarch_kernel", "key", "new", str(path)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr and "remove it first" in again.stderr, again
    path.chmod(0o640)
    worker = subprocess.run([sys.executable, "-m", "monarch_kernel.agent", "--listen", "tcp://127.0.0.1:0",
                             "--key-file", str(path)], capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2 and f"chmod 600 {path}" in worker.stderr, worker
    # The controller refuses it too, before it connects to anything: this listener hears nobody.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        with pytest.raises(KeyFileError, match=r"may be read by others \(mode 0640\).*chmod 600"):
            attach_to_workers(workers=[f"tcp://127.0.0.1:{listener.getsockname()[1]}"], key=str(path))
        with pytest.raises(TimeoutError):
            listener.accept()
    path.write_text("not a key\n")
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="not a monarch-kernel key file"):
        attach_to_workers(workers=["tcp://127.0.0.1:1"], key=str(path))
    with pytest.raises(ValueError, match="give the host's name or address and the port"):
        attach_to_workers(workers=["tcp://127.0.0.1"], key=str(path))
    # Monarch's ca= has no open mode here: it says what to give instead.
    with pytest.raises(TypeError, match=r"give key= the path of a key file \(for Monarch's ca= and private_key=\)"):
        attach_to_workers(workers=["tcp://127.0.0.1:1"], ca="trust_all_connections")
    with pytest.raises(TypeError, match="key new PATH"):
        run_worker_loop_forever(address="tcp://127.0.0.1:0", ca="trust_all_connections")


def test_an_attach_job_is_dumped_without_its_key(key, tmp_path):
    job = AttachJob(["tcp://node1:29500", "tcp://10.0.0.2:29500"], key, name="trainers")
    path = str(tmp_path / "job.json")
    job.dump(path)
    with open(key) as f:
        secret = f.read().split()[-1]
    with open(path) as f:
        assert secret not in f.read()
    again = job_load(path)
    assert (again.kind, again.workers, again.key_file, again.name) == ("attach", job.workers, key, "trainers")
    with pytest.raises(ValueError, match="tcp://node1:29500 is given more than once"):
        AttachJob(["tcp://node1:29500", "tcp://node1:29500"], key)


# ---------------------------------------------------------------- controllers in turn


FIRST_CONTROLLER = '''
import os, sys, time
sys.path[:0] = {tests!r}
from monarch_kernel import attach_to_workers
from test_attach import Where
hosts = attach_to_workers(workers={workers!r}, key={key!r})
procs = hosts.spawn_procs(per_host={{"gpus": 2}})
pids = sorted(pid for pid, _ns in procs.spawn("w", Where).where.call().get(timeout=60).values())
print(" ".join(map(str, pids)), flush=True)
time.sleep(120)
'''


def test_workers_outlive_their_controller_and_serve_the_next(workers, key, tmp_path):
    w1, w2 = workers(2)
    script = tmp_path / "first.py"
    script.write_text(FIRST_CONTROLLER.format(tests=SCRIPT_PATH, workers=[w1.address, w2.address],
                                              key=key))
    first = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None
        pids = [int(p) for p in first.stdout.readline().split()]
        assert len(pids) == 4 and all(running(p) for p in pids), pids
        # While it holds them, another controller is told who does.
        with pytest.raises(ConnectionError, match=rf"the worker {w1.address} .* serves another controller: the "
                                                  rf"controller tcp://\S+ \(pid {first.pid} on"):
            attach_to_workers(workers=[w1.address], key=key)
    finally:
        first.kill()  # no goodbye: the workers learn it from their connections' end
        first.wait(10)
        first.stdout.close()
    # The second controller, this process, at once: it waits while the workers end the first one's ranks.
    hosts = attach_to_workers(workers=[w1.address, w2.address], key=key)
    assert_gone(pids, 15, "the first controller's ranks outlived it")
    for w in (w1, w2):
        w.wait_for("connection closed .*waiting for the next controller")
        assert w.proc.poll() is None
    assert hosts.extent == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"gpus": 1})
    assert procs.extent == {"hosts": 2, "gpus": 1}
    got = procs.spawn("w", Where).where.call().get(timeout=60)
    second = sorted(pid for pid, _ns in got.values())
    assert len(second) == 2 and not set(second) & set(pids)
    # stop(): the ranks end, the workers wait for the next controller.
    hosts.stop().get(timeout=30)
    assert_gone(second, 15, "stop() left ranks running")
    w1.wait_for("the controller let go of it; waiting for the next controller")
    assert w1.proc.poll() is None and w2.proc.poll() is None
    # shutdown(): the workers exit.
    again = attach_to_workers(workers=[w1.address, w2.address], key=key)
    again.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call().get(timeout=60)
    again.shutdown().get(timeout=30)
    assert w1.proc.wait(20) == 0 and w2.proc.wait(20) == 0
    w1.wait_for(r"exiting \(the controller shut it down\)")


def test_a_controller_that_falls_silent_loses_its_ranks_and_the_next_one_attaches(workers, key, tmp_path):
    """A stopped (or cut off) controller keeps its connection open: the agent's heartbeat is
    what tells the worker it is gone."""
    (w,) = workers(1)
    script = tmp_path / "first.py"
    script.write_text(FIRST_CONTROLLER.format(tests=SCRIPT_PATH, workers=[w.address], key=key))
    first = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None
        pids = [int(p) for p in first.stdout.readline().split()]
        assert len(pids) == 2, pids
        first.send_signal(signal.SIGSTOP)
        assert_gone(pids, 20, "the ranks of a silent controller outlived its silence")
        w.wait_for(r"the controller has been silent for .*waiting for the next controller")
        hosts = attach_to_workers(workers=[w.address], key=key)
        assert hosts.spawn_procs().spawn("w", Where).nap.call_one(0).get(timeout=60) == "woke"
        hosts.stop().get(timeout=30)
    finally:
        first.kill()
        first.wait(10)
        first.stdout.close()


# ---------------------------------------------------------------- who may attach


def test_a_wrong_key_is_refused_before_anything_is_unpickled_and_the_worker_keeps_serving(workers, key, tmp_path):
    (w,) = workers(1)
    other = new_key_file(str(tmp_path / "other.key"))
    with pytest.raises(PermissionError, match=rf"cannot attach to the worker {w.address}: it refused this "
                                              "controller's key"):
        attach_to_workers(workers=[w.address], key=other)
    w.wait_for(r"rejected input on the worker wire \(forged\): a connection from 127\.0\.0\.1 does not hold")
    # A peer that sends a pickle where the proof goes: the worker reads 48 bytes, refuses, and
    # closes; nothing was unpickled (the pickle would have made the marker file).
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    host, port = w.address[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        hello = worker_wire.recv_exact(s, 4 + worker_wire.NONCE, time.monotonic() + 10)
        assert hello[:4] == worker_wire.MAGIC
        s.sendall(pickle.dumps(Bomb()).ljust(worker_wire.HELLO, b".") * 4)
        assert worker_wire.recv_exact(s, 4, time.monotonic() + 10) == worker_wire.REFUSED
        assert s.recv(1) == b""  # closed
    assert not marker.exists()
    assert "attached by" not in w.log()
    # The worker serves a controller with the key as if nothing happened.
    hosts = attach_to_workers(workers=[w.address], key=key)
    assert hosts.spawn_procs().spawn("w", Where).nap.call_one(0).get(timeout=60) == "woke"
    hosts.shutdown().get(timeout=30)


def test_connections_that_never_prove_the_key_are_bounded(workers, key):
    (w,) = workers(1)
    host, port = w.address[len("tcp://"):].rsplit(":", 1)

    def dial(source: str) -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(10)
        s.connect((host, int(port)))
        return s

    idle = [dial("127.0.0.2") for _ in range(MAX_UNAUTHENTICATED_PER_PEER)]
    try:
        for s in idle:  # each is in its handshake: it got the greeting
            assert worker_wire.recv_exact(s, 4, time.monotonic() + 10) == worker_wire.MAGIC
        with dial("127.0.0.2") as extra:  # one too many from that peer: turned away at once
            assert worker_wire.recv_exact(extra, 4, time.monotonic() + 10) == worker_wire.BUSY
            assert extra.recv(1) == b""
        # Another peer is not held up by them.
        hosts = attach_to_workers(workers=[w.address], key=key)
        hosts.stop().get(timeout=30)
        # The idle ones are closed once the handshake's deadline passes.
        t = time.monotonic()
        for s in idle:
            s.settimeout(worker_wire.HANDSHAKE_S + 10)
            while s.recv(4096):
                pass
        assert time.monotonic() - t < worker_wire.HANDSHAKE_S + 5
    finally:
        for s in idle:
            s.close()
    with dial("127.0.0.2") as again:  # room again for that peer
        assert worker_wire.recv_exact(again, 4, time.monotonic() + 10) == worker_wire.MAGIC


# Run by another user (uid 65534), without the key: hold as many of the worker's handshake
# slots as it lets it from five loopback addresses, taking another as soon as one closes; half
# send the first byte of a proof, to be held the whole handshake deadline.
STARVE = r"""
import selectors, socket, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
sel = selectors.DefaultSelector()
def dial(source, i):
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
            s.setblocking(False)
            if i % 2:
                s.send(b"x")
            sel.register(s, selectors.EVENT_READ, (source, i))
            return
        except OSError:
            time.sleep(0.01)
for source in ["127.0.0.%d" % k for k in range(2, 7)]:
    for i in range(16):
        dial(source, i)
print("holding", flush=True)
threading.Thread(target=lambda: (sys.stdin.read(), sel.close()), daemon=True).start()
while True:
    try:
        events = sel.select(0.5)
    except (OSError, ValueError):
        break
    for key, _ in events:
        try:
            gone = key.fileobj.recv(4096) == b""
        except BlockingIOError:
            continue
        except OSError:
            gone = True
        if gone:
            sel.unregister(key.fileobj)
            key.fileobj.close()
            time.sleep(0.005)
            dial(*key.data)
"""


def test_keyless_peers_from_five_addresses_cannot_starve_an_attach(workers, key):
    """Another user without the key holds handshake slots from 127.0.0.2-6 (16 each, more than
    the 64 there are) and takes one again as soon as one closes: the worker gives an address
    with no slot one of the busiest address's, and drops a peer that has not begun its proof
    within a second, so a controller's attach takes under 2 s (before: 6-26 s)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as another local user")
    (w,) = workers(1)
    host, port = w.address[len("tcp://"):].rsplit(":", 1)
    attacker = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                                 "-c", STARVE, host, port], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "holding"
        time.sleep(1.5)  # (the flood settles: slots held, the rest turned away and trying again)
        for _ in range(3):
            t = time.monotonic()
            hosts = attach_to_workers(workers=[w.address], key=key)
            took = time.monotonic() - t
            seen = len(w.lines)
            hosts.stop().get(timeout=30)
            assert took < 2, f"an attach under the flood took {took:.1f} s"
            w.wait_for(r"waiting for the next controller", after=seen)
        assert attacker.poll() is None
    finally:
        if attacker.stdin is not None:
            attacker.stdin.close()
        try:
            attacker.wait(10)
        except subprocess.TimeoutExpired:
            attacker.kill()
            attacker.wait(10)
        if attacker.stdout is not None:
            attacker.stdout.close()


class Probe(Actor):
    @endpoint
    def where(self) -> tuple:
        try:
            import mymodel  # type: ignore[import-not-found]  (only in the other user's folder)

            got = mymodel.VALUE
        except ImportError:
            got = "not imported"
        return os.getcwd(), got


def test_folders_another_user_made_at_the_controllers_paths_are_not_used_on_a_host(workers, key, tmp_path,
                                                                                   monkeypatch, capfd):
    """Another user (uid 65534) makes, on a worker's host, the folder at one of the controller's
    sys.path entries (with a ``mymodel.py``) and the one at its working folder: the ranks
    there neither import from the first nor run in the second, and the spawn says so once."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to make folders as another local user")
    base = f"/tmp/mk-theirs-{os.getpid()}"
    made = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
                           f"mkdir -p {base}/path {base}/cwd && echo 'VALUE = \"theirs\"' > {base}/path/mymodel.py"],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    try:
        (w,) = workers(1)  # (started in the test's own folder, as one on another host is in its own)
        monkeypatch.syspath_prepend(f"{base}/path")
        monkeypatch.chdir(f"{base}/cwd")
        hosts = attach_to_workers(workers=[w.address], key=key)
        try:
            probe = hosts.spawn_procs(per_host={"gpus": 2}).spawn("probe", Probe)
            got = set(probe.where.call().get(timeout=60).values())
            assert len(got) == 1
            cwd, imported = got.pop()
            assert imported == "not imported" and cwd != f"{base}/cwd", (cwd, imported)
            said = ""
            deadline = time.monotonic() + 20
            while "do not use the controller's folders" not in said and time.monotonic() < deadline:
                time.sleep(0.2)
                said += "".join(capfd.readouterr())
            assert f"{base}/path ({base}/path belongs to another user (uid 65534))" in said, said
            assert f"{base}/cwd ({base}/cwd belongs to another user (uid 65534))" in said, said
            assert said.count("do not use the controller's folders") == 1, said  # once, not per rank
        finally:
            hosts.stop().get(timeout=30)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- a worker that dies


def test_a_killed_worker_fails_its_ranks_calls_with_process_died_naming_it(workers, key):
    w1, w2 = workers(2)
    hosts = attach_to_workers(workers=[w1.address, w2.address], key=key)
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1})
        m = procs.spawn("w", Where)
        pids = {pid for pid, _ns in m.where.call().get(timeout=60).values()}
        pending = m.slice(hosts=0).nap.call(60)
        time.sleep(0.3)
        w1.proc.kill()
        t = time.monotonic()
        with pytest.raises(ProcessDied, match=rf"the worker {re.escape(w1.address)} is gone"):
            pending.get(timeout=30)
        assert time.monotonic() - t < 5
        assert m.slice(hosts=1).nap.call_one(0).get(timeout=30) == "woke"
        assert_gone(pids - {pid for pid, _ns in m.slice(hosts=1).where.call().get(timeout=30).values()}, 15,
                    "the killed worker's ranks outlived it")
    finally:
        hosts.shutdown().get(timeout=30)


def test_attaching_again_from_the_same_controller_reuses_or_takes_back_its_workers(workers, key):
    """A cell run again: the same attach reuses the attachment and its ranks; another one over
    the same workers takes them back (the earlier ranks end); neither is "another controller"."""
    w1, w2 = workers(2)
    hosts = attach_to_workers(workers=[w1.address, w2.address], key=key)
    try:
        first = {pid for pid, _ns in hosts.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call()
                 .get(timeout=60).values()}
        again = attach_to_workers(workers=[w1.address, w2.address], key=key)  # the same cell again
        assert again.host_names == hosts.host_names
        assert all(running(p) for p in first)
        got = again.spawn_procs(per_host={"gpus": 1}).spawn("w", Where).where.call().get(timeout=60)
        assert len(got) == 2
        assert sum("attached by" in line for line in w1.lines) == 1, w1.log()
        # Edited (another name, one worker): this controller takes its workers back.
        other = attach_to_workers(workers=[w1.address], key=key, name="trainers")
        assert_gone(first, 15, "the ranks of the attachment taken back outlived it")
        m = other.spawn_procs(per_host={"gpus": 1}).spawn("w", Where)
        assert len(m.where.call().get(timeout=60)) == 1
        w2.wait_for("the controller let go of it; waiting for the next controller")
        other.shutdown().get(timeout=30)
        assert w1.proc.wait(20) == 0
    finally:
        hosts.shutdown().get(timeout=30)


def test_a_rank_on_a_worker_is_replaced_there_and_one_whose_worker_is_gone_moves_to_the_other(workers, key):
    """The restart policy through hosts' agents (issue 44 point 1): a rank SIGKILLed on a worker
    is replaced on that worker; a killed worker's rank is replaced on the other worker (which
    has room), at a new address there, and the mesh answers from both."""
    w1, w2 = workers(2)
    hosts = attach_to_workers(workers=[w1.address, w2.address], key=key)
    try:
        procs = hosts.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
        m = procs.spawn("w", Where)
        pids = [pid for pid, _ns in m.where.call().get(timeout=60).values()]
        os.kill(pids[1], signal.SIGKILL)
        event = procs.wait_restart(after=0, timeout=60)
        assert (event.kind, event.ranks, event.moved_from) == ("restart", (1,), ("",)), event
        again = m.slice(hosts=1).where.call_one().get(timeout=30)[0]
        assert again != pids[1] and running(again)
        before = procs.ref
        w1.proc.kill()
        moved = procs.wait_restart(after=1, timeout=60)
        assert (moved.kind, moved.ranks, moved.moved_from) == ("restart", (0,), (before.hosts[0],)), moved
        assert procs.ref.addresses[0] != before.addresses[0] and procs.ref.addresses[1] == before.addresses[1]
        pid = m.slice(hosts=0).where.call_one().get(timeout=30)[0]
        assert pid in [c.pid for c in psutil.Process(w2.proc.pid).children(recursive=True)]  # forked by w2
        assert m.slice(hosts=1).nap.call_one(0).get(timeout=30) == "woke"
    finally:
        hosts.shutdown().get(timeout=30)


# ---------------------------------------------------------------- another host



@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair: (namespace, its address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace (`make test` installs iproute2)")
    with veth_namespace("att", 150) as (ns, here, there):
        yield ns, there


ANOTHER_HOST = '''
import os, sys
sys.path[:0] = {tests!r}
from monarch_kernel import attach_to_workers
from test_attach import Where
hosts = attach_to_workers(workers=[{worker!r}], key={key!r})
print(hosts.host_names, flush=True)
got = hosts.spawn_procs(per_host={{"gpus": 2}}).spawn("w", Where).where.call().get(timeout=60)
print(sorted({{ino for _pid, ino in got.values()}}), flush=True)
hosts.shutdown().get(timeout=30)
'''


def test_a_worker_on_another_host_runs_ranks_there(workers, key, other_host, tmp_path):
    """The controller is a fresh process: one listens on its route to its first job's hosts."""
    ns, address = other_host
    (w,) = workers(1, ip=address, prefix=("ip", "netns", "exec", ns))
    assert w.address.startswith(f"tcp://{address}:")
    script = tmp_path / "controller.py"
    script.write_text(ANOTHER_HOST.format(tests=SCRIPT_PATH, worker=w.address, key=key))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    names, inodes = out.stdout.splitlines()
    assert names == str([address])
    here = os.stat("/proc/self/ns/net").st_ino
    there = os.stat(f"/run/netns/{ns}").st_ino
    assert inodes == str([there]) and there != here  # the ranks ran in the worker's namespace
    assert w.proc.wait(20) == 0
    left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
    assert not left, f"processes left in the worker's namespace: {left}"


def test_a_worker_that_torchrun_starts(workers, key):
    """The torchrun recipe of docs/guides/beyond-one-machine.md, on one node: the ranks get none
    of torchrun's variables."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1")
    (w,) = workers(1, python=torchrun)
    hosts = attach_to_workers(workers=[w.address], key=key)
    try:
        m = hosts.spawn_procs().spawn("w", Where)
        assert [m.env.call_one(v).get(timeout=60) for v in ("RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")] == \
            [None, None, None]
    finally:
        hosts.stop().get(timeout=30)
    assert w.proc.poll() is None  # torchrun's worker waits for the next controller


# ---------------------------------------------------------------- from a notebook


def test_a_notebook_attaches_with_mesh_spawn_attach(workers, key, kc):
    from support.kernels import run

    (w,) = workers(1)
    out = run(kc, "procs = %mesh spawn --attach tcp://127.0.0.1:1", timeout=60).text
    assert "--attach needs the workers' key" in out, out
    out = run(kc, f"procs = %mesh spawn --attach {w.address} --key-file {key} -n 2", timeout=120).text
    assert "mesh procs: 2 ranks on job attach0" in out, out
    out = run(kc, "%%mesh\nimport os\nprint('ns', os.getppid() != 0)", timeout=60).text
    assert "[ranks 0-1] ns True" in out or ("[rank 0] ns True" in out and "[rank 1] ns True" in out), out
    assert "attach0 (attach): running" in run(kc, "%mesh jobs").text
    out = run(kc, "%mesh kill-job", timeout=60).text
    assert "job attach0 killed with its meshes procs" in out, out
    assert w.proc.wait(20) == 0
    w.wait_for(r"exiting \(the controller shut it down\)")
