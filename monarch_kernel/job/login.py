"""``SlurmJob(login="user@cluster")``: a controller outside the cluster (a laptop) drives Slurm
and reaches the mesh through one ssh connection to the cluster's login node.

The connection is an ssh ControlMaster (its control socket in the controller's 0700 run
directory) that every ``sbatch``, ``squeue``, ``srun`` and ``scancel`` reuses.  Its own command
is the relay (``login_relay.py``) when the nodes cannot reach the controller (``out_of_cluster``):
each controller port is forwarded (``-R``) to a unix socket in the relay's 0700 folder on the
login node, and the relay listens at the same port on the login node's cluster-facing address
(one another program holds there is ``PortTaken``: the controller moves to another port);
the agents and ranks reach the controller there (``MONARCH_KERNEL_CONTROLLER_VIA=IP@RELAY``).
The controller reaches each node's addresses through the same connection (``-L`` to unix
sockets in its run directory; the login node connects onward).  The controller listens on
loopback only; Curve and the HMAC authenticate every connection end to end.
"""

from __future__ import annotations

import collections
import os
import queue
import secrets
import shlex
import subprocess
import threading
import time

from ..runtime.hosting import PortTaken, Runtime, config
from .tunnels import Tunnels, _ip, _port

RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "login_relay.py")
OPEN_TIMEOUT_S = config.seconds("slurm_command_timeout")


# (login, ssh_args) -> the connection this process's jobs through that login node share: one
# relay per controller and login node (a second would find the controller's ports taken there)
_shared: dict[tuple, LoginNode] = {}


def shared_login(login: str, ssh_args, rundir: str) -> LoginNode:
    """The connection to ``login`` that this process's jobs share, one more job using it;
    each job gives it back with ``LoginNode.let_go(job)``."""
    key = (login, tuple(ssh_args))
    node = _shared.get(key)
    if node is None or node.closed:
        node = _shared[key] = LoginNode(login, ssh_args, rundir, f"L{secrets.token_hex(3)}")
    node.users += 1
    return node


def agent_settings() -> dict[str, str]:
    """This controller's MONARCH_KERNEL_ settings, for the agents (ssh does not carry its
    environment), less its own bind address and route."""
    own = (config.env_name("bind_address"), config.env_name("controller_via"))
    return {k: v for k, v in os.environ.items() if k.startswith("MONARCH_KERNEL_") and k not in own}


class LoginNode:
    """The ssh connection to ``login`` (``user@host`` or a name ssh's configuration knows)."""

    def __init__(self, login: str, ssh_args=(), rundir: str = "", tag: str = "L"):
        self.login = login
        self.ssh_args = tuple(ssh_args)
        self.ctl = os.path.join(rundir, f"ssh{tag}")
        self._tag = tag
        self._rundir = rundir
        self.proc: subprocess.Popen | None = None
        self.folder = ""  # the relay's folder on the login node
        self.relay_ip: str | None = None  # where the nodes reach the relay
        self._target = ""  # a node: the relay listens on the login node's route toward it
        self._said: queue.Queue[str | None] = queue.Queue()  # the relay's lines; None at its exit
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._lock = threading.Lock()
        self._ports: set[int] = set()  # controller ports relayed so far
        self._tunnels: dict[int, list[Tunnels]] = {}  # id(job) -> the forwards to its nodes
        self._made = 0  # forwards' tags made so far
        self._unhook: list = []
        self.users = 0  # jobs using this connection (``shared_login``)
        self.closed = False

    # ------------------------------------------------------------ the connection

    def open(self) -> None:
        """Connect (once): the master, running the relay; raises saying why ssh could not."""
        if self.proc is not None and self.proc.poll() is None:
            return
        with open(RELAY) as f:
            source = f.read()
        argv = ["ssh", "-M", "-S", self.ctl, "-o", "ControlPersist=no", "-o", "BatchMode=yes",
                "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3", "-o", "StreamLocalBindUnlink=yes",
                *self.ssh_args, self.login, "--",
                f"exec python3 -c {shlex.quote(source)} {int(config.get('relay_connections'))}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, text=True)
        threading.Thread(target=self._read, args=(self.proc.stdout,), name="monarch-login-out", daemon=True).start()
        err = threading.Thread(target=self._read_err, args=(self.proc.stderr,), name="monarch-login-err", daemon=True)
        err.start()
        first = self._next(OPEN_TIMEOUT_S)
        if first is None or not first.startswith("dir "):
            exited = self.proc.poll() is not None
            if exited:
                err.join(2)  # all ssh said, for the message
            why = self._why()
            self.close()
            raise ConnectionError(why)
        self.folder = first[len("dir "):]

    def _read(self, out) -> None:
        with out:
            for line in out:
                if line.startswith("mk-relay "):
                    self._said.put(line[len("mk-relay "):].strip())
        self._said.put(None)

    def _read_err(self, err) -> None:
        with err:
            for line in err:
                if line.strip():
                    self._stderr.append(line.rstrip())

    def _next(self, timeout: float) -> str | None:
        try:
            got = self._said.get(timeout=timeout)
        except queue.Empty:
            return None
        if got is None:
            self._said.put(None)  # every later reader sees the exit too
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
        return got

    def _why(self) -> str:
        text = "\n".join(self._stderr)
        said = ("; ssh said:\n  " + "\n  ".join(self._stderr)) if self._stderr else ""
        where = f"cannot open an ssh connection to the login node {self.login}"
        if "Permission denied (" in text or "Host key verification failed" in text:
            return (f"{where}: authentication failed; check the user and key in login= and ssh_args= (ssh runs "
                    f"with BatchMode=yes, so it never asks for a password){said}")
        if "Could not resolve hostname" in text:
            return f"{where}: ssh cannot resolve its name; check login= (or the Host entry in ~/.ssh/config){said}"
        if "python3" in text and ("not found" in text or "No such file" in text):
            return f"the login node {self.login} has no python3 on PATH: this job's relay runs there{said}"
        if self.proc is not None and self.proc.poll() is None:
            return f"{where}: it did not answer in {OPEN_TIMEOUT_S:g} s{said}"
        return f"{where} (ssh exited with status {self.proc.returncode if self.proc else '?'}){said}"

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """ssh running ``argv`` (with ``env`` added) on the login node, through the master."""
        prefix = shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " if env else ""
        return ["ssh", "-S", self.ctl, "-o", "ControlMaster=no", "-o", "BatchMode=yes", *self.ssh_args, self.login,
                "--", prefix + shlex.join(argv)]

    def run(self, argv: list[str], input: str | None, timeout: float) -> subprocess.CompletedProcess:
        """``argv`` on the login node.  Raises FileNotFoundError when its shell cannot find the
        command, ConnectionError when ssh itself fails (exit 255 with the master gone)."""
        r = subprocess.run(self.command(argv), input=input, capture_output=True, text=True, timeout=timeout,
                           stdin=None if input is not None else subprocess.DEVNULL)
        if r.returncode == 127 and ("not found" in r.stderr or "No such file" in r.stderr):
            raise FileNotFoundError(argv[0])
        if r.returncode == 255 and (self.proc is None or self.proc.poll() is not None):
            raise ConnectionError(f"the ssh connection to the login node {self.login} is gone: "
                                  f"{r.stderr.strip() or self._why()}")
        return r

    def let_go(self, job) -> None:
        """``job`` no longer uses this connection (its forwards go); the last one closes it."""
        for tunnels in self._tunnels.pop(id(job), []):
            tunnels.cancel()
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        """End the relay (its stdin closes), then the master; forget the hooks and forwards."""
        self.closed = True
        if _shared.get((self.login, self.ssh_args)) is self:
            del _shared[(self.login, self.ssh_args)]
        for undo in self._unhook:
            undo()
        self._unhook, self._tunnels = [], {}
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            subprocess.run(["ssh", "-S", self.ctl, "-O", "exit", self.login], capture_output=True, timeout=10,
                           stdin=subprocess.DEVNULL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------ out of cluster

    def reach(self, rt: Runtime, target: str, links: dict, job) -> str:
        """Make the controller reachable from the nodes through the relay, and the nodes' addresses
        (their ``links``' ips) from the controller, for ``job``; ``target``: a node's address, as
        the login node knows it.  Returns MONARCH_KERNEL_CONTROLLER_VIA's value for the agents.
        A second job of this controller through the same login node uses the same relay."""
        self._target = self._target or target
        if not self._unhook:  # first: a port rt.listen opens now is relayed (or moved) before it returns
            self._unhook = [rt.on_listen(self.relay), rt.add_dialer(self._dial)]
        controller = rt.listen("127.0.0.1")  # no network port, unless one is open
        for address in rt.tcp_addresses():
            self.relay(address)
        made = []
        for link in links.values():
            made.append(Tunnels(self.login, self._rundir, f"{self._tag}{self._made}", _ip(controller), link,
                                ctl=self.ctl))
            self._made += 1
        self._tunnels[id(job)] = made
        return f"{_ip(controller)}@{self.relay_ip}"

    def relay(self, address: str) -> None:
        """The controller's port of ``address``, listened for on the login node and forwarded
        there.  The relay listens first: a port another program holds there is ``PortTaken``
        before anything is forwarded, and the controller listens at another port instead."""
        port = _port(address)
        with self._lock:
            if port in self._ports or not self._target:
                return
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(f"listen {self._target} {port}\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            deadline = time.monotonic() + 15
            got = self._next(max(0.0, deadline - time.monotonic()))
            if got is None or not got.startswith("listening "):
                why = got.split(" ", 2)[-1] if got else self._why()
                if "in use" in why:
                    raise PortTaken(f"the relay on the login node {self.login} cannot listen at port {port} for the "
                                    f"nodes: {why} (another job of this controller that reaches the cluster through "
                                    "this login node holds it: use that job, or kill it first; or another program "
                                    "there listens on it)")
                raise ConnectionError(f"the relay on the login node {self.login} cannot listen at port {port} for "
                                      f"the nodes: {why}")
            r = subprocess.run(["ssh", "-S", self.ctl, "-O", "forward", "-R",
                                f"{self.folder}/{port}:{_ip(address)}:{port}", self.login],
                               capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise ConnectionError(f"cannot forward this controller's port {port} to the login node {self.login}: "
                                      f"{r.stderr.strip() or r.returncode}")
            self.relay_ip = got.split()[1]
            self._ports.add(port)

    def _dial(self, address: str) -> str | None:
        for tunnels in [t for made in list(self._tunnels.values()) for t in made]:
            got = tunnels.dial(address)
            if got:
                return got
        return None
