"""Starting a host's agent through a launcher command, and saying why one did not come up.

The launcher (``ssh host python -m monarch_kernel.agent``, or ``srun ... python -m
monarch_kernel.agent``) gets the credentials on its stdin, which then stays open: its EOF,
when the controller exits, is how the agent learns it is alone.  A thread reads the
launcher's stderr (kept for the error message) and tells the runtime at once when the
launcher exits, so a killed agent fails its ranks without waiting for the heartbeat.
"""

from __future__ import annotations

import collections
import ipaddress
import re
import socket
import subprocess
import threading
import time

from ..runtime.hosting import Runtime, config
from ..runtime.hosting import agent_channel as wire
from .tunnels import port_taken

AGENT_MODULE = "monarch_kernel.agent"


def controller_address(rt: Runtime, first_host: str) -> str:
    """Listen for the job's hosts on the address of our route to ``first_host``, or on
    MONARCH_KERNEL_BIND; returns the controller's TCP address.  A controller that already
    listens keeps its address unless that one is of the loopback or gone (``Network.listen``)."""
    ip = config.bind_address()
    if ip is None:
        try:
            ip = route_to(first_host)
        except ConnectionError:
            ours = rt.net_address
            if ours is not None and not ours.startswith("tcp://127."):  # a name only the hosts know: keep ours
                return ours
            raise
    return rt.listen(ip)


def route_to(host: str) -> str:
    """This machine's source address toward ``host`` (a name or an IP)."""
    try:
        target = socket.getaddrinfo(host, 22, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except socket.gaierror as e:
        raise ConnectionError(f"cannot resolve host {host!r}: {e.strerror}") from None
    if ipaddress.ip_address(target).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # sends nothing: picks the route
        return s.getsockname()[0]


class AgentProcess:
    """One host's agent, started by ``argv`` (the launcher command)."""

    def __init__(self, rt: Runtime, host: str, argv: list[str], controller: str, env: dict | None = None,
                 remote_kill=None, link=None):
        """``remote_kill(pid)``: how to end the remote process when it never came up (its
        launcher command then prints ``mk-agent-pid PID`` first); None when ending the
        launcher ends it (srun).  ``link``: the host's link, when made before (``add_host``)."""
        self.rt = rt
        self.host = host
        self.argv = argv
        self.link = link if link is not None else rt.add_host(host)
        self.stderr: collections.deque[str] = collections.deque(maxlen=40)
        self.remote_kill = remote_kill
        self.remote_pid: int | None = None
        self.dialed: float | None = None  # when it said it dials the controller (stdout read only)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE if remote_kill else subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True, env=env)
        if remote_kill is not None:
            threading.Thread(target=self._read_stdout, name=f"monarch-agent-stdout-{host}", daemon=True).start()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(self.link.credentials(controller))
            self.proc.stdin.flush()
        except OSError:
            pass  # it exited at once; the watcher says why
        self.exited = threading.Event()
        threading.Thread(target=self._watch, name=f"monarch-agent-{host}", daemon=True).start()

    def _read_stdout(self) -> None:
        """The remote shell's pid (to end it), and when the agent began dialing."""
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for raw in self.proc.stdout:
                word, _, pid = raw.decode(errors="replace").strip().partition(" ")
                if word == "mk-agent-pid" and pid.isdigit():
                    self.remote_pid = int(pid)
                elif word == wire.DIALING and self.dialed is None:
                    self.dialed = time.monotonic()

    def _watch(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for raw in self.proc.stderr:
                self.stderr.append(raw.decode(errors="replace").rstrip())
        code = self.proc.wait()
        self.exited.set()
        why = f"its launcher ({self.argv[0]}) exited with status {code}"
        if self.stderr:
            why += f": {self.stderr[-1]}"
        self.rt.io.call_soon(self.link.gone, why)

    def reached(self, reach: float, deadline: float) -> bool:
        """Wait until the agent connects, exits, has dialed for ``reach`` seconds, or
        ``deadline`` passes: False when it runs still unconnected, or exited saying its host has
        no route to this controller.  A launcher whose stdout is not read (no ``remote_kill``)
        times ``reach`` from now: its agent's start cannot be seen."""
        started = time.monotonic()
        while not self.link.up.wait(0.05):
            now = time.monotonic()
            since = self.dialed if self.remote_kill is not None else started
            if self.exited.is_set() or now > deadline or (since is not None and now > since + reach):
                break
        if self.exited.is_set():
            return not any(line.startswith(wire.UNREACHED) for line in self.stderr)
        return self.link.up.done()

    def wait_up(self, deadline: float, python: str) -> None:
        """Until the agent has connected, or raise saying what went wrong on the host."""
        while not self.link.up.wait(0.05):
            if self.exited.is_set() or time.monotonic() > deadline:
                break
        if self.link.up.done() and self.link.up.error() is None:
            return
        if not self.exited.is_set() and time.monotonic() > deadline:
            self.kill()
            raise TimeoutError(
                f"the agent on {self.host} did not connect back in time (is this controller's address "
                f"{self.rt.net_address} reachable from {self.host}? set MONARCH_KERNEL_BIND to one that is"
                + (", or pass out_of_cluster=True to reach it through ssh)" if self._direct_ssh() else ")")
                + self._said())
        self.exited.wait(2)
        raise ConnectionError(self.diagnose(python))

    def _direct_ssh(self) -> bool:
        return self.argv[0] == "ssh" and "ControlMaster=yes" not in self.argv

    def _said(self) -> str:
        return ("; it said:\n  " + "\n  ".join(self.stderr)) if self.stderr else ""

    def diagnose(self, python: str) -> str:
        """Why the agent on this host could not start, with what to do about it."""
        text = "\n".join(self.stderr)
        code = self.proc.returncode
        said = self._said()
        if taken := re.search(r"remote port forwarding failed for listen port (\d+)", text):
            return port_taken(self.host, taken[1]) + said
        if wire.NO_ROUTE in text or wire.NEVER_HEARD in text:
            how = "has no route to" if wire.NO_ROUTE in text else "heard nothing back from"
            return (f"{self.host} {how} this controller's address {self.rt.net_address}: set "
                    "MONARCH_KERNEL_BIND to one it can reach"
                    + (", or pass out_of_cluster=True to reach it through ssh" if self._direct_ssh() else "") + said)
        if "Permission denied (" in text or "Host key verification failed" in text:
            return (f"cannot start the agent on {self.host}: ssh authentication failed; check the key "
                    f"and user in ssh_args (ssh runs with BatchMode=yes, so it never asks for a password){said}")
        if any(s in text for s in ("Could not resolve", "Connection refused", "Connection timed out",
                                   "No route to host", "Network is unreachable")):
            return f"cannot reach {self.host} over ssh{said}"
        if code == 255 and self.argv[0] == "ssh":  # ssh's own failure, not the remote command's
            return f"ssh to {self.host} failed (check ssh_args: {' '.join(self.argv[1:-3])}){said}"
        if f"No module named {AGENT_MODULE}" in text or "No module named 'monarch_kernel'" in text \
                or "No module named monarch_kernel" in text:
            return (f"monarch_kernel is not installed for {python} on {self.host}: run "
                    f"`ssh {self.host} {python} -m pip install monarch-kernel` (or install this checkout there), "
                    f"or point python_exe at an interpreter that has it, or pass sync_env=True (%mesh spawn "
                    f"--sync-env) to send this controller's environment there{said}")
        if code == 127 or "command not found" in text or f"{python}: No such file" in text:
            return (f"{python} was not found on {self.host}: pass python_exe= the path of a Python 3 "
                    f"interpreter there{said}")
        return f"the agent on {self.host} exited with status {code} before connecting{said}"

    def kill(self) -> None:
        """Tell the agent to end its ranks and exit, close its stdin, and end the launcher."""
        came_up = self.link.alive and self.link.up.done() and self.link.up.error() is None
        if came_up:
            self.rt.end_host(self.link)
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if not came_up and self.proc.poll() is None and self.remote_kill and self.remote_pid:
            # It never connected (stuck, or not reading its stdin): end it on its host.
            try:
                self.remote_kill(self.remote_pid)
            except Exception:  # noqa: BLE001  (best effort: the host may be unreachable)
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.exited.wait(1)
