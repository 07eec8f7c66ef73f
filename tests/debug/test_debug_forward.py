"""A rank's debugger through a port forward, the way VS Code reaches it from another machine.
Through a forward every connection comes from the user's own forwarder (ssh), so the port's
uid check passes anyone who reaches the forward's local end.  Two forwarders stand in for
ssh's ends; an attacker run as another user (uid 65534, the system's python) connects
through them first, with a full DAP session that would run ``id``; then the user's own
client attaches as VS Code does, with the printed launch.json entry's fields, and gets a
stopped thread, its stack and an evaluate."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from support.dap import Session
from support.dap_attacker import SPIN, attack
from support.other_user import NOBODY, SYSTEM_PYTHON
from support.other_user import needs_other_users as _needs_other_users

pytestmark = pytest.mark.timeout(180)

# A TCP forwarder (one end of ssh -L): listens on argv[1] (host), prints its port, and
# carries each connection to argv[2]:argv[3] in both directions.
FORWARD = r'''
import socket, sys, threading
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((sys.argv[1], int(sys.argv[4]) if len(sys.argv) > 4 else 0))
listener.listen(16)
print(listener.getsockname()[1], flush=True)
while True:
    client, _ = listener.accept()
    try:
        far = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=10)
    except OSError:
        client.close()
        continue
    for a, b in ((client, far), (far, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
'''


class Forwarders:
    """The forwarders a test started (as this user, as ssh runs), ended at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, listen_on: str, to_host: str, to_port: int, netns: str | None = None,
              port: int | None = None) -> int:
        command = [sys.executable, "-c", FORWARD, listen_on, to_host, str(to_port)]
        if port is not None:
            command.append(str(port))
        if netns is not None:
            command = ["ip", "netns", "exec", netns, *command]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip().isdigit(), f"the forwarder did not start: {line!r}"
        return int(line)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def forwarders():
    f = Forwarders()
    yield f
    f.stop()


def _entry(out: str) -> dict:
    return json.loads(out[out.index("{"):])


def _through_a_forward(s: Session, forwarders: Forwarders, netns: str | None, there: str | None) -> tuple:
    """``%mesh debug 0 --listen``, and what VS Code on another machine would connect to: the
    local end of a forward to the printed entry's port (and, where the kernel prints an
    ``ssh -L`` to the rank's host, the two ends of that forward first)."""
    out = s.cell("%mesh debug 0 --listen")
    entry = _entry(out)
    host, port = entry["connect"]["host"], entry["connect"]["port"]
    hop = re.search(r"ssh -N -L (\d+):127\.0\.0\.1:(\d+) (\S+)", out)
    if hop and netns is not None and hop[3] == there:  # a forward to the rank's host (7598c87's way)
        far = forwarders.start(there, "127.0.0.1", int(hop[2]), netns=netns)
        forwarders.start("127.0.0.1", there, far, port=int(hop[1]))
    laptop = forwarders.start("127.0.0.1", host, port)  # VS Code's machine's end of ssh -L
    fields = {k: v for k, v in entry.items() if k not in ("name", "type", "request", "connect")}
    return ("tcp", "127.0.0.1", laptop), fields


def _attacked_then_attached(s: Session, forwarders, tmp_path, netns=None, there=None) -> None:
    target, fields = _through_a_forward(s, forwarders, netns, there)
    s.cell(SPIN.replace("--ranks 1", "--ranks 0"))
    marker = tmp_path / "ran-as-the-notebook-user"
    # Another user, through the forward: whatever it sends, nothing of it runs on the rank.
    for guess in ({}, {"monarchSessionSecret": "0" * 43}, {"monarchSessionSecret": None}):
        got = attack([target], marker, NOBODY, attach_args=guess)
        assert got[target] in ("closed", "answered"), got
        assert not marker.exists(), marker.read_text()
    # The user's own client, as VS Code sends the entry's fields: in, and it runs code.
    got = attack([target], marker, [], attach_args=fields)
    assert got == {target: "ran"}, got
    assert marker.read_text().startswith("uid="), marker.read_text()
    assert "[rank 0] 3" in s.cell("%%mesh --ranks 0\n1 + 2")


def test_another_user_gets_nothing_through_a_forward_to_a_local_ranks_debugger(kc, tmp_path, forwarders):
    _needs_other_users()
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 1")
    _attacked_then_attached(s, forwarders, tmp_path)


def test_another_user_gets_nothing_through_a_forward_to_a_ranks_debugger_on_another_host(
        kc, tmp_path, forwarders, other_host):
    _needs_other_users()
    ns, there = other_host
    s = Session(kc)
    s.cell(f"procs = %mesh spawn -n 1 --env MONARCH_KERNEL_NETNS={ns}")
    _attacked_then_attached(s, forwarders, tmp_path, netns=ns, there=there)
    s.cell("%mesh stop")


def test_a_stranger_who_connects_first_does_not_close_the_port_on_the_user(kc):
    """The port takes one client: the first one that proves itself, not the first to connect."""
    from monarch_kernel.debug.dap import DapConnection

    _needs_other_users()
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 1")
    entry = _entry(s.cell("%mesh debug 0 --listen"))
    host, port = entry["connect"]["host"], entry["connect"]["port"]
    hold = (f"import socket, sys; s = socket.create_connection(({host!r}, {port})); "
            "print(s.recv(1) == b'', flush=True)")
    stranger = subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c", hold], capture_output=True, text=True, timeout=30)
    assert stranger.stdout.strip() == "True", stranger  # closed unread
    wrong = DapConnection(host, port, lambda _m: None)
    try:
        assert wrong.request("initialize", {"adapterID": "python"}).result(30)["success"]
        refused = wrong.request("attach", {"monarchSessionSecret": "not it"}).result(30)
        assert not refused["success"] and "monarchSessionSecret" in refused["message"], refused
    finally:
        wrong.close()
    events: list[dict] = []
    conn = DapConnection(host, port, events.append)
    try:
        first = conn.request("initialize", {"adapterID": "python"}).result(30)
        assert first["success"], first
        pending = conn.request("attach", {"justMyCode": False, "monarchSessionSecret": entry["monarchSessionSecret"]})
        deadline = 30
        end = time.monotonic() + deadline
        while not any(e.get("event") == "initialized" for e in events):
            assert time.monotonic() < end, f"timed out after {deadline} s waiting for debugpy's initialized event"
            time.sleep(0.05)
        # debugpy's own capabilities came as an event, before anything else of the rank's.
        caps = next(e for e in events if e.get("event") == "capabilities")["body"]["capabilities"]
        assert caps["supportsSetVariable"] and caps["exceptionBreakpointFilters"], caps
        assert conn.request("configurationDone").result(30)["success"] and pending.result(30)["success"]
        conn.request("disconnect", {"terminateDebuggee": False}).result(30)
    finally:
        conn.close()


def test_requests_sent_with_the_attach_at_once_are_not_lost(kc):
    """A client that does not wait for answers (initialize, attach, configurationDone in one
    write): what came after the attach goes to the rank too, once the secret matched."""
    import socket

    from monarch_kernel.debug.dap import FrameReader, encode

    s = Session(kc)
    s.cell("procs = %mesh spawn -n 1")
    entry = _entry(s.cell("%mesh debug 0 --listen"))
    requests = [{"seq": 1, "type": "request", "command": "initialize", "arguments": {"adapterID": "python"}},
                {"seq": 2, "type": "request", "command": "attach",
                 "arguments": {"justMyCode": False, "monarchSessionSecret": entry["monarchSessionSecret"]}},
                {"seq": 3, "type": "request", "command": "configurationDone", "arguments": {}}]
    with socket.create_connection((entry["connect"]["host"], entry["connect"]["port"]), timeout=30) as sock:
        sock.sendall(b"".join(encode(r) for r in requests))
        reader, answered = FrameReader(), set()
        deadline = time.monotonic() + 30
        while answered != {1, 2, 3}:
            assert time.monotonic() < deadline, f"timed out after 30 s waiting for answers to 1-3: {answered}"
            data = sock.recv(65536)
            assert data, f"the port closed with answers to {answered} only"
            for msg in reader.feed(data):
                if msg.get("type") == "response":
                    assert msg["success"], json.dumps(msg)
                    answered.add(msg["request_seq"])
