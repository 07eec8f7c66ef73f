"""Nobody but the rank's own user reaches a rank's debugger.  A real 2-rank mesh, debugpy
started on rank 1 as ``%mesh debug 1 --listen`` starts it, and an attacker run as another
user (uid 65534, the system's python) that tries every socket the rank's debug machinery
listens on (read from /proc for the rank and its descendants) with DAP initialize, attach,
pause, stackTrace and an evaluate that would write a file as the notebook's user.  The same
attacker as the rank's own user, through the printed ``--listen`` entry, runs its code: so
the attack is real.  Another host (a network namespace) finds nothing listening at all."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import time

import psutil
import pytest
from support.dap import Session
from support.dap_attacker import SPIN, attack
from support.other_user import NOBODY, SYSTEM_PYTHON, needs_other_users

pytestmark = pytest.mark.timeout(150)


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} lists it (32-bit words in host byte order), as text."""
    raw = b"".join(struct.pack("=I", int(hex_address[i:i + 8], 16)) for i in range(0, len(hex_address), 8))
    return socket.inet_ntoa(raw) if len(raw) == 4 else socket.inet_ntop(socket.AF_INET6, raw)


def _listeners(pid: int) -> set[tuple]:
    """Every socket process ``pid`` listens on, read from /proc/PID (so in its own network
    namespace): ("tcp", address, port) and ("unix", path or @abstract name)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found: set[tuple] = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ip, port = fields[1].rsplit(":", 1)
                    found.add(("tcp", _address(ip), int(port, 16)))
    with open(f"/proc/{pid}/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]
            if len(fields) > 7 and fields[6] in inodes and int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON
                found.add(("unix", fields[7]))
    return found


def _family(rank_pid: int) -> list[int]:
    return [rank_pid] + [p.pid for p in psutil.Process(rank_pid).children(recursive=True)]


def _debug_listeners(rank_pid: int, before: set[tuple]) -> set[tuple]:
    """What the rank's debug machinery listens on: the sockets its descendants (debugpy's
    adapter) listen on, and those the rank itself opened since ``before``."""
    found = _listeners(rank_pid) - before
    for pid in _family(rank_pid)[1:]:
        try:
            found |= _listeners(pid)
        except FileNotFoundError:  # it ended meanwhile (the `id` the attack ran, say)
            pass
    return found


def _ports(listeners: set[tuple]) -> set[tuple]:
    return {t for t in listeners if t[0] == "tcp"}


def _wait(what: str, check, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)
    return got


def _rank_pid(s: Session, rank: int) -> int:
    return int(s.cell(f"%%mesh --ranks {rank}\nimport os\nos.getpid()").split()[-1])


_needs_other_users = needs_other_users


def _listen(s: Session, rank: int) -> tuple[tuple, dict]:
    """``%mesh debug R --listen``: the port of its entry, and the entry's fields VS Code sends
    in its attach request."""
    out = s.cell(f"%mesh debug {rank} --listen")
    entry = json.loads(out[out.index("{"):])
    fields = {k: v for k, v in entry.items() if k not in ("name", "type", "request", "connect")}
    return ("tcp", entry["connect"]["host"], entry["connect"]["port"]), fields


def test_another_user_gets_nothing_from_a_ranks_debugger_and_the_user_gets_in(kc, tmp_path):
    _needs_other_users()
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    kernel_pid = _kernel_pid(s)
    rank_pid = _rank_pid(s, 1)
    before = _listeners(rank_pid)
    listen, fields = _listen(s, 1)
    s.cell(SPIN)  # a thread to pause (started after debugpy, so it is traced)
    # The --listen port is the kernel's; the rank listens for no client at all.
    assert listen in _listeners(kernel_pid), listen
    targets = _debug_listeners(rank_pid, before) | {listen}
    # Ports on the loopback only; unix sockets (the new helper actors' inboxes) in the run directory.
    assert all(t[1] == "127.0.0.1" for t in _ports(targets)), targets
    assert all(t[1].startswith(s.cell("%%mesh --ranks 1\nimport tempfile\nprint(tempfile.gettempdir())").split()[-1])
               for t in targets - _ports(targets)), targets
    marker = tmp_path / "ran-as-the-notebook-user"

    got = attack(targets, marker, NOBODY, attach_args=fields)  # even holding the secret
    assert set(got) == targets and all(v in ("refused", "closed", "EACCES") for v in got.values()), got
    assert not marker.exists(), marker.read_text()

    # The rank's own user, with the printed entry, gets in (after the other user's tries).
    got = attack([listen], marker, [], attach_args=fields)
    assert got == {listen: "ran"}, got
    assert marker.read_text().startswith(f"uid={os.geteuid()}"), marker.read_text()
    # That session over, the port it came through is gone; the rank runs on.
    _wait(f"port {listen[2]} to close", lambda: listen not in _listeners(kernel_pid))
    assert "[rank 1] 3" in s.cell("%%mesh --ranks 1\n1 + 2")


def test_a_listen_port_takes_one_client_and_goes_away_with_its_session(kc):
    from monarch_kernel.debug.dap import DapConnection

    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    kernel_pid = _kernel_pid(s)
    rank_pid = _rank_pid(s, 1)
    before, kernel_before = _listeners(rank_pid), _listeners(_kernel_pid(s))
    first, _fields = _listen(s, 1)
    internal = _ports(_debug_listeners(rank_pid, before))
    assert len(internal) == 1, internal  # pydevd's way to the adapter (this user only)
    # Asked again before anyone used it: a new port, and the old one closes.
    listen, fields = _listen(s, 1)
    assert listen != first
    _wait("the unused --listen port to close", lambda: _listeners(kernel_pid) - kernel_before == {listen})
    events: list[str] = []
    conn = DapConnection(listen[1], listen[2], lambda m: events.append(m["event"]))
    try:
        assert conn.request("initialize", {"adapterID": "python"}).result(30)["success"]
        pending = conn.request("attach", {"justMyCode": False, **fields})
        _wait("debugpy's initialized event", lambda: "initialized" in events, 30)
        # The port took its one client: it is gone while the session goes on.
        _wait("the used --listen port to close", lambda: listen not in _listeners(kernel_pid))
        assert conn.request("configurationDone").result(30)["success"] and pending.result(30)["success"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(listen[1:], timeout=5).close()
        conn.request("disconnect", {"terminateDebuggee": False}).result(30)
    finally:
        conn.close()
    # JupyterLab's panel on the rank opens no port at all.
    out = s.cell("%mesh debug 1")
    assert "now debugs rank 1" in out, out
    assert _ports(_debug_listeners(rank_pid, before)) == internal


def test_another_host_finds_nothing_of_the_debugger_listening(kc, tmp_path, other_host):
    _needs_other_users()
    ns, address_there = other_host
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    rank_pid = _rank_pid(s, 1)
    before = _listeners(rank_pid)
    listen, fields = _listen(s, 1)
    s.cell(SPIN)
    targets = _ports(_debug_listeners(rank_pid, before)) | {listen}
    assert len(targets) == 2 and all(t[1] == "127.0.0.1" for t in targets), targets
    ours = address_there.rsplit(".", 1)[0] + ".1"  # this host, as the other one reaches it
    marker = tmp_path / "ran-from-another-host"
    from_there = {("tcp", ours, t[2]) for t in targets}
    got = attack(from_there, marker, [], netns=ns, attach_args=fields)
    assert got == {t: "refused" for t in from_there}, got
    assert not marker.exists()


@pytest.mark.parametrize("line, hint", [
    ("%mesh debug 1 --listen --host 0.0.0.0", "--host 0.0.0.0 is not a loopback address"),
    ("%mesh debug 1 --listen --host ::", "ssh -N -L PORT:127.0.0.1:PORT"),
])
def test_listen_refuses_an_address_beyond_loopback_before_starting_anything(kc, line, hint):
    from support.kernels import run, text

    run(kc, "procs = %mesh spawn -n 2")
    rank_pid = int(text(run(kc, "%%mesh --ranks 1\nimport os\nos.getpid()")[0]).split()[-1])
    out, reply = run(kc, line)
    assert reply["status"] == "error" and reply["ename"] == "UsageError", text(out)
    assert hint in reply["evalue"]
    assert not psutil.Process(rank_pid).children(), "something was started on the rank"


def test_a_loopback_peer_is_known_by_its_user_and_a_gone_one_is_nobody():
    """The check behind every debug port: the owner of the connecting socket, from
    /proc/net/tcp; a peer that closed at once is listed as uid 0, so it must count as nobody."""
    _needs_other_users()
    from monarch_kernel.debug import peer_uid

    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as listener:
            listener.bind((host, 0))
            listener.listen(4)
            port = listener.getsockname()[1]
            with socket.create_connection((host, port)), listener.accept()[0] as conn:
                assert peer_uid.peer_uid(conn) == os.geteuid() and peer_uid.from_this_user(conn)
            hold = f"import socket, sys; s = socket.create_connection(({host!r}, {port})); sys.stdin.read()"
            other = subprocess.Popen([*NOBODY, SYSTEM_PYTHON, "-c", hold], stdin=subprocess.PIPE)
            try:
                conn = listener.accept()[0]
                with conn:
                    assert peer_uid.peer_uid(conn) == 65534 and not peer_uid.from_this_user(conn)
            finally:
                other.communicate(timeout=10)
            gone = f"import socket; socket.create_connection(({host!r}, {port})).close()"
            subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c", gone], check=True, timeout=10)
            conn = listener.accept()[0]
            with conn:
                # The peer's socket is no process's now: listed (if at all) as uid 0, inode 0.
                conn.settimeout(10)
                assert conn.recv(1) == b"", "the other user's connection did not end"
                assert peer_uid.peer_uid(conn) is None and not peer_uid.from_this_user(conn)



KERNEL_SPIN = ("import threading, time\ndef _spin():\n    while True:\n        time.sleep(0.02)\n"
               "threading.Thread(target=_spin, name='spin', daemon=True).start()")


def _kernel_debug_ports(kernel_pid: int, before: set[tuple]) -> set[tuple]:
    """The TCP ports the kernel's debug machinery opened since ``before``: those the kernel and
    its children (debugpy's adapter) listen on, and those the kernel connects to on the
    loopback (ipykernel's client to the adapter, pydevd to it: debugpy's own adapter is no
    child of the kernel, it daemonizes)."""
    found: set[tuple] = set()
    for pid in _family(kernel_pid):
        try:
            found |= _ports(_listeners(pid))
        except FileNotFoundError:
            pass
    kernel = psutil.Process(kernel_pid)
    connections = kernel.net_connections("tcp") if hasattr(kernel, "net_connections") else kernel.connections("tcp")
    for c in connections:
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.ip == "127.0.0.1" and \
                ("tcp", c.laddr.ip, c.laddr.port) not in found | before:  # not one the kernel accepted
            found.add(("tcp", c.raddr.ip, c.raddr.port))
    return found - before


def _attack_the_kernel(targets: set[tuple], tmp_path) -> None:
    # ipykernel's client port and pydevd's, on the loopback only.
    assert len(targets) == 2 and all(t[1] == "127.0.0.1" for t in targets), targets
    marker = tmp_path / "ran-in-the-kernel"
    got = attack(targets, marker, NOBODY)
    assert set(got) == targets and all(v in ("refused", "closed") for v in got.values()), got
    assert not marker.exists(), marker.read_text()


def _the_panel_still_stops_and_evaluates(s: Session) -> None:
    from support.dap import start_debugger

    start_debugger(s)
    code = "kv = 7\nkv2 = kv * 2\nprint(kv2)"
    path = s.dap("dumpCell", {"code": code})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 2}]})["success"]
    assert s.dap("configurationDone")["success"]
    msg_id = s.execute(code)
    thread = s.wait_event("stopped")["body"]["threadId"]
    frame = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"][0]
    assert frame["line"] == 2
    evaluated = s.dap("evaluate", {"expression": "kv + 5", "frameId": frame["id"], "context": "repl"})
    assert evaluated["body"]["result"] == "12", evaluated
    assert s.dap("continue", {"threadId": thread})["success"]
    assert "14" in s.wait_done(msg_id)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]


def _kernel_pid(s: Session) -> int:
    return int(s.cell("import os\nos.getpid()").split()[-1])


def test_another_user_gets_nothing_from_the_kernels_own_debugger(kc, tmp_path):
    """JupyterLab's debugger on the kernel itself (ipykernel starts debugpy at the panel's
    initialize): its ports take only the kernel's user; the panel's session works before
    and after the attack, through the same port."""
    _needs_other_users()
    from support.dap import start_debugger

    s = Session(kc)
    kernel_pid = _kernel_pid(s)
    before = _kernel_debug_ports(kernel_pid, set())
    start_debugger(s)
    s.cell(KERNEL_SPIN)  # a thread to pause (started after debugpy, so it is traced)
    targets = _kernel_debug_ports(kernel_pid, before)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    _attack_the_kernel(targets, tmp_path)
    _the_panel_still_stops_and_evaluates(s)


def test_another_user_gets_nothing_from_the_kernels_debugger_after_debug_off(kc, tmp_path):
    """The panel on a rank first; ``%mesh debug off`` starts the kernel's debugpy from a cell."""
    _needs_other_users()
    from support.dap import start_debugger

    s = Session(kc)
    kernel_pid = _kernel_pid(s)
    assert "now debugs rank 1" in s.cell("procs = %mesh spawn -n 2\n%mesh debug 1")
    start_debugger(s)
    before = _kernel_debug_ports(kernel_pid, set())
    assert "debugs the kernel itself" in s.cell("%mesh debug off")
    s.cell(KERNEL_SPIN)
    targets = _kernel_debug_ports(kernel_pid, before)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    _attack_the_kernel(targets, tmp_path)
    _the_panel_still_stops_and_evaluates(s)


def test_a_cells_source_written_for_the_debugger_is_readable_by_its_user_alone(tmp_path):
    from monarch_kernel.debug.rank.rank_debugpy import write_source

    shared = tmp_path / "ipykernel_1"  # ipykernel makes its folder with the default mode
    shared.mkdir(mode=0o755)
    path = shared / "123.py"
    write_source(str(path), "secret = 1\n")
    assert path.read_text() == "secret = 1\n"
    assert os.stat(path).st_mode & 0o077 == 0, oct(os.stat(path).st_mode)
    write_source(str(path), "secret = 2\n")  # rewritten in place, still private
    assert path.read_text() == "secret = 2\n" and os.stat(path).st_mode & 0o077 == 0


def test_a_ranks_debug_adapter_ends_with_its_mesh_though_a_client_is_still_on(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    rank_pid = _rank_pid(s, 1)
    listen, fields = _listen(s, 1)
    adapters = [psutil.Process(p) for p in _family(rank_pid)[1:]
                if "debug_adapter" in " ".join(psutil.Process(p).cmdline())]
    assert len(adapters) == 1, _family(rank_pid)
    def request(seq: int, command: str, arguments: dict) -> bytes:
        body = json.dumps({"seq": seq, "type": "request", "command": command, "arguments": arguments}).encode()
        return b"Content-Length: %d\r\n\r\n" % len(body) + body

    client = socket.create_connection(listen[1:], timeout=30)
    try:
        client.sendall(request(1, "initialize", {"adapterID": "test"}))
        assert client.recv(65536), "the port did not answer initialize"
        client.sendall(request(2, "attach", fields))
        s.cell("%mesh stop")  # the ranks end while a client is in session with rank 1's adapter
        gone, left = psutil.wait_procs(adapters, timeout=20)
        assert not left, f"rank 1's debug adapter outlived its rank by 20 s: {[p.pid for p in left]}"
    finally:
        client.close()
