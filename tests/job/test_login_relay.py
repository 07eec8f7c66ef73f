"""The login node's relay (``job/login_relay.py``) under a flood of connections, run as another
user (uid 65534, the system's python) under a small process limit, as on a shared login node
where its threads count against the user's own limit: it joins at most the connections it is
told, closes the rest as they come, starts no thread per connection, and a real connection
after the flood is joined as before."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import threading
import time

import pytest

from monarch_kernel.job import login

pytestmark = pytest.mark.timeout(120)

OTHER_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]


def _needs_other_user() -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit") \
            or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root, setpriv, prlimit and /usr/bin/python3 to run the relay as another user")


class Echo:
    """The controller's forward on the login node: a unix socket that echoes what it gets."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chown(path, 65534, 65534)  # as ssh's forward is the relay's user's
        self.sock.listen(512)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass
        conn.close()  # its peer said all: so does it (as ssh's channel does)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _line(proc: subprocess.Popen, deadline: float) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the relay exited ({proc.poll()}) before saying a line"
    assert time.monotonic() < deadline, "timed out waiting for the relay's line"
    return line.strip()


def _echoed(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_a_flood_of_connections_under_a_process_limit_leaves_the_relay_serving():
    _needs_other_user()
    with open(login.RELAY) as f:
        source = f.read()
    most = 100
    proc = subprocess.Popen(["prlimit", "--nproc=48:48", *OTHER_USER, "-c", source, str(most)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    echo = None
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        folder = _line(proc, deadline).removeprefix("mk-relay dir ")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        echo = Echo(os.path.join(folder, str(port)))
        assert proc.stdin is not None
        proc.stdin.write(f"listen 127.0.0.1 {port}\n")
        proc.stdin.flush()
        assert _line(proc, deadline) == f"mk-relay listening 127.0.0.1 {port}"
        assert _echoed(port, b"before") == b"before"

        for _ in range(300):  # held open, sending nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            flood.append(s)
        # Past the most it holds, the relay closes a connection as soon as it takes it.
        closed: set[socket.socket] = set()
        t = time.monotonic()
        while len(closed) < 300 - most and time.monotonic() - t < 10:
            readable, _, _ = select.select([s for s in flood if s not in closed], [], [], 0.5)
            closed.update(s for s in readable if s.recv(1) == b"")
        closed_n = len(closed)
        assert closed_n >= 300 - most, f"only {closed_n} of 300 connections were closed (it holds {most})"
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        for s in flood:
            s.close()
        flood.clear()
        # A real connection after the flood is joined and its bytes go both ways.
        data = os.urandom(1 << 20)
        t = time.monotonic()
        while True:
            try:
                if _echoed(port, data) == data:
                    break
            except OSError:
                pass
            assert time.monotonic() - t < 20, "the relay no longer joins connections after the flood"
            time.sleep(0.2)
        assert proc.poll() is None
    finally:
        for s in flood:
            s.close()
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        if echo is not None:
            echo.close()
