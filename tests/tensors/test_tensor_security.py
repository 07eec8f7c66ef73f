"""What distributed tensors and torch.distributed open on a shared machine and network, tried
as the neighbours would try it: a host in a network namespace of its own (joined to this one
by a veth pair) and another local user (uid 65534, the system's python, no torch: raw
sockets).  On a real 2-rank mesh, after a reduce and a move: the controller opens no port
for the ranks' rendezvous (its keys travel as the runtime's signed messages), the only TCP
listeners are gloo's own, on the loopback; the link sockets' names tell nothing of the
activation; torch's MASTER_PORT store binds MASTER_ADDR (127.0.0.1) alone and a torchrun
script's ``init_process_group()`` still meets there."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap

import psutil
import pytest
from support.cluster import veth_namespace
from support.gpus import default_backend

import monarch_kernel as mk
from monarch_kernel import Actor, ActorError, endpoint, inspect, this_host
from monarch_kernel.runtime.process import Runtime
from monarch_kernel.spmd import setup_torch_distributed, setup_torch_elastic_env
from monarch_kernel.tensors.controller.registry import tensor_client

pytestmark = pytest.mark.timeout(240)
torch = pytest.importorskip("torch")

OTHER_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]

# Run by the attacker (no torch): try each (host, port), each path, and list the abstract
# socket names every local user can read.
ATTACK = r"""
import json, socket, sys
todo = json.loads(sys.argv[1])
out = {"tcp": [], "unix": [], "names": []}
for host, port in todo["tcp"]:
    try:
        socket.create_connection((host, port), timeout=3).close()
        out["tcp"].append("connected")
    except OSError as e:
        out["tcp"].append(type(e).__name__)
for path in todo["unix"]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(b"set x y", path)
        out["unix"].append("sent")
    except OSError as e:
        out["unix"].append(type(e).__name__)
    finally:
        s.close()
if todo.get("names"):
    with open("/proc/net/unix") as f:
        out["names"] = [line.split()[-1] for line in f if "@monarch-kernel" in line]
print(json.dumps(out))
"""


class Where(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def torchrun_script(self, path: str) -> bool:
        """What ``%mesh run`` has each rank's console run (``console_code``)."""
        from monarch_kernel.spmd import run_script

        return run_script([path])

    @endpoint
    def drop_group(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        where = procs.spawn("where", Where)
        yield procs, where, list(where.pid.call().get(timeout=60).values())


@pytest.fixture(scope="module")
def reduced(mesh):
    """A reduce and a move (straight between the two ranks' memories, over their link
    sockets) on the mesh; what listened before them."""
    procs, _where, pids = mesh
    before = {pid: _listening(pid) for pid in [os.getpid(), *pids]}
    with procs.activate():
        t = procs.rank_tensor("gpus").float() + torch.ones(4)  # rank i holds i + 1
        total = t.reduce("gpus", "sum")
    assert inspect(total, gpus=1).tolist() == [3.0] * 4
    first, second = procs.slice(gpus=0), procs.slice(gpus=1)
    with first.activate():
        x = torch.arange(3.0)
    assert inspect(mk.to_mesh(x, second)).tolist() == [0.0, 1.0, 2.0]
    return before


def _listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def _attack(prefix: list[str], todo: dict) -> dict:
    out = subprocess.run([*prefix, "-c", ATTACK, json.dumps(todo)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _other_user() -> list[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as another local user")
    return OTHER_USER



@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair: another host on the same
    network.  Yields (namespace, this host's address on that network)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root and iproute2 to create a network namespace (`make test` installs iproute2)")
    with veth_namespace("sec", 200) as (ns, here, there):
        yield ns, here


def _link_names(pids: list[int]) -> set[str]:
    """The abstract unix sockets these processes listen on (their links, links.py)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f][1:]
    return {r[7] for r in rows if len(r) == 8 and r[6] in inodes and r[7].startswith("@monarch-kernel")}


def test_a_reduce_and_a_move_open_no_store_and_only_gloo_listens_on_the_loopback(mesh, reduced):
    _procs, _where, pids = mesh
    # The controller opened nothing: the ranks' rendezvous is a port of this process, reached
    # by the runtime's signed messages (before, a TCPStore listened on every interface).
    assert _listening(os.getpid()) == reduced[os.getpid()]
    for pid in pids:
        # What a rank listens on is gloo's own: one listener per process group (here, the
        # reduce's), on an ephemeral port of the loopback, since both ranks share this host.
        new = _listening(pid) - reduced[pid]
        assert new and {ip for ip, _port in new} == {"127.0.0.1"}, new


def test_another_host_reaches_no_listener_of_the_mesh(mesh, reduced, other_host):
    procs, _where, pids = mesh
    ns, here = other_host
    setup_torch_distributed(procs)  # torch's MASTER_PORT store and its default group too
    ports = sorted({port for pid in [os.getpid(), *pids] for _ip_, port in _listening(pid)})
    assert ports
    with socket.socket() as control:  # the other host does reach this one where a listener lets it
        control.bind((here, 0))
        control.listen()
        got = _attack(["ip", "netns", "exec", ns, "/usr/bin/python3"],
                      {"tcp": [[here, p] for p in ports] + [[here, control.getsockname()[1]]], "unix": []})
    assert got["tcp"][-1] == "connected", got
    reached = [p for p, r in zip(ports, got["tcp"], strict=False) if r == "connected"]
    assert not reached, f"another host connected to ports {reached} of the controller or its ranks"


def test_another_user_reaches_no_store_and_no_socket_name_tells_the_prefix(mesh, reduced):
    attacker = _other_user()
    procs, _where, pids = mesh
    prefix = tensor_client(procs).backend.rendezvous.prefix
    store_ports = sorted(port for _ip_, port in _listening(os.getpid()) - reduced[os.getpid()])
    rundir = os.path.dirname(Runtime.current().address.removeprefix("ipc://"))
    inboxes = [os.path.join(rundir, name) for name in sorted(os.listdir(rundir))]
    links = _link_names(pids)
    assert links, "the move made no link sockets: nothing below would be checked"
    with socket.socket() as control:  # the other user does reach a loopback listener
        control.bind(("127.0.0.1", 0))
        control.listen()
        tcp = [[host, p] for p in store_ports for host in ("127.0.0.1", "::1")] + [
            ["127.0.0.1", control.getsockname()[1]]]
        got = _attack(attacker, {"tcp": tcp, "unix": inboxes, "names": True})
    # No store port: the keys are reached only through the controller's inbox, in its 0700
    # run directory (EACCES for anyone else).
    assert store_ports == [] and got["tcp"] == ["connected"], got
    assert inboxes and set(got["unix"]) == {"PermissionError"}, got
    # Every local user reads the link sockets' names; none carries the activation's prefix.
    assert links <= set(got["names"]), (links, got["names"])
    assert not [n for n in got["names"] if prefix in n], got["names"]
    for pid in pids:  # nor does a rank's command line or environment
        for what in ("cmdline", "environ"):
            with open(f"/proc/{pid}/{what}", "rb") as f:
                assert prefix.encode() not in f.read(), f"rank {pid}'s {what} holds the prefix"


# Run by the attacker: connect to the abstract socket named argv[1] as often as it takes
# (argv[2] times at most, never waiting), say how many, and hold them until stdin closes.
FLOOD = r"""
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect("\0" + sys.argv[1])
    except OSError:
        s.close()
        continue
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_another_users_connections_to_a_link_socket_are_closed_at_once(mesh, reduced):
    """Another user connects 200 times to rank 0's link socket (its name is in /proc/net/unix
    for all to read) while the ranks make new links (moves on new streams): the rank closes
    each stranger's connection as it accepts it, so its descriptors stay as they were (before,
    it kept them until its links closed: 43 to 109 descriptors)."""
    attacker = _other_user()
    procs, _where, pids = mesh
    (name,) = _link_names([pids[0]])
    first, second = procs.slice(gpus=0), procs.slice(gpus=1)
    fds = _fds(pids[0])
    made = 0
    for i in range(4):
        flood = subprocess.Popen([*attacker, "-c", FLOOD, name.removeprefix("@"), str(200 - made)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and flood.stdin is not None
            made += int(flood.stdout.readline() or 0)
            stream = mk.Stream(f"flood{i}")  # a new stream: rank 0 accepts a new link (and what waits before it)
            with first.activate(), stream.activate():
                x = torch.arange(3.0) + i
            with stream.activate():
                assert inspect(mk.to_mesh(x, second)).tolist() == [i, i + 1.0, i + 2.0]
        finally:
            if flood.stdin is not None:
                flood.stdin.close()
            flood.wait(30)
            if flood.stdout is not None:
                flood.stdout.close()
    assert made >= 200, f"the attacker made only {made} connections"
    # One link per new stream, and a little room for what else the rank opened meanwhile.
    assert _fds(pids[0]) <= fds + 4 + 2, f"rank 0 went from {fds} to {_fds(pids[0])} descriptors"


SCRIPT = """
import os, sys
import psutil, torch, torch.distributed as dist
dist.init_process_group("gloo")
port = int(os.environ["MASTER_PORT"])
listening = sorted({(c.laddr.ip, c.pid == os.getpid()) for c in psutil.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[0] + ".out", os.environ["RANK"]), "w") as f:
    f.write(repr((t.item(), listening)))
dist.destroy_process_group()
"""


def test_torchs_store_listens_on_master_addr_alone_and_a_torchrun_script_meets_there(mesh, tmp_path):
    procs, where, pids = mesh
    where.drop_group.call().get(timeout=60)  # (an earlier test's): the script makes its own
    addr, port = setup_torch_elastic_env(procs)  # what %mesh run does first
    assert addr == "127.0.0.1"
    # RANK 0 serves it, as torchrun's agent would, bound to MASTER_ADDR alone.
    assert [(pid, ip) for pid in [os.getpid(), *pids] for ip, p in _listening(pid) if p == port] == [
        (pids[0], "127.0.0.1")]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "train.py.out").mkdir()
    assert list(where.torchrun_script.call(str(script)).get(timeout=120).values()) == [True, True]
    # Each rank's init_process_group() met at the store (rank 0 serves it: its own listener).
    assert (tmp_path / "train.py.out" / "0").read_text() == repr((3.0, [("127.0.0.1", True)]))
    assert (tmp_path / "train.py.out" / "1").read_text() == repr((3.0, [("127.0.0.1", False)]))
    # The script destroyed its group: the store went with it (a later run meets fresh keys).
    assert not [p for pid in pids for _ip_, p in _listening(pid) if p == port]
    # setup_torch_distributed: the same, under its own group
    assert setup_torch_distributed(procs) == default_backend(2)
    envs = [e for e in where.torchrun_script.call(str(_env_script(tmp_path))).get(timeout=120).values()]
    assert envs == [True, True]
    (addr2, port2), = {tuple(json.loads((tmp_path / f"env.{r}").read_text())) for r in (0, 1)}
    assert addr2 == "127.0.0.1" and port2 != port
    assert [(pid, ip) for pid in [os.getpid(), *pids] for ip, p in _listening(pid) if p == port2] == [
        (pids[0], "127.0.0.1")]


def test_a_master_addr_or_port_rank_0_cannot_serve_says_what_to_pass(mesh):
    procs, _where, _pids = mesh
    with pytest.raises(ActorError, match=r"MASTER_ADDR '192\.0\.2\.1' is not an address of rank 0's host .*pass one "
                       r"of its addresses, or master_addr=None"):
        setup_torch_elastic_env(procs, "192.0.2.1", 29500)  # (TEST-NET-1: nobody's address)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ActorError, match=rf"MASTER_PORT {port} is in use on 127\.0\.0\.1 .*pass another "
                           r"master_port, or None for a free one"):
            setup_torch_elastic_env(procs, "127.0.0.1", port)


def _env_script(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(f"""
        import json, os
        import torch.distributed as dist
        dist.init_process_group()  # a no-op: the rank has setup_torch_distributed's group
        assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        with open({str(tmp_path)!r} + "/env." + os.environ["RANK"], "w") as f:
            json.dump([os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])], f)
    """))
    return path
