"""Simulated multi-host clusters for tests, on one machine, as root: hosts are network
namespaces on a Linux bridge, each with its own hostname (a UTS namespace) and its own
``/etc/hosts`` (a mount namespace); the controller (the test process) stays in the root
namespace and reaches them over the bridge, and they reach it, and each other, through it.
The hosts share everything else with the machine: the file system (this checkout and its
.venv included), users, /dev/shm, pids.

Two clusters, each built once per session and checked after every test that uses it:

``ssh_hosts`` (function scope; ``ssh_hosts_session`` is the same object, session scope)
    two hosts, each running its own ``sshd`` on port 22 of its address, which accepts the
    generated ``.key`` for root.  ``ssh *ssh_hosts.ssh_args HOST CMD`` runs CMD there.
``slurm_cluster`` (function scope; ``slurm_cluster_session`` is the same, session scope)
    ``munged`` and ``slurmctld`` in the root namespace and one ``slurmd`` per node
    namespace; ``sbatch``/``srun``/``squeue``/``scancel`` with ``.env`` drive it.

After each test (and at the end of the session) every process still running in a host's
namespace, other than its daemon, fails the test: processes started through sshd or slurmd
do not carry conftest's session mark, so this is the check that catches what a test leaves
on a "remote" host.  They are listed with their command lines, then killed.  Links cut with
``cut()`` are restored first, and Slurm jobs still queued are cancelled (and fail the test).

Every subprocess run here has a timeout; the daemons' logs are printed when they fail to
start.  The daemons die with the process that started them (``PR_SET_PDEATHSIG``), so a
pytest killed before its teardown leaves none running; its namespaces and bridges are
removed by the next session that builds a network (``Network.sweep``).  Without root,
``ip``, ``sshd`` or Slurm's daemons the fixtures skip, saying which.

Imported as ``support.cluster`` (tests/ is on sys.path); conftest.py imports the fixtures so
every test module can ask for them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import psutil
import pytest

SESSION_MARK = "MONARCH_KERNEL_TEST_SESSION"  # conftest's mark; daemons are started without it
GRACE_S = 5.0  # how long processes left in a host's namespace get to exit after a test
# ... and a history writer more: it outlives its controller (or agent) by design until it has
# converted what it was given, at a low CPU priority, which a loaded machine makes slow.
WRITER_GRACE_S = 60.0
LATE_S = 5.0  # past its grace, a process that is described and then ends within this was slow, not left
SSHD = "/usr/sbin/sshd"
SLURM_DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
SLURM_CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo")
PKG_HINT = "`make test` installs it as root"
OWNERS = "/run/monarch-kernel-test-networks"  # one file per network: who made it, what to delete


def run(cmd: Sequence[str], *, timeout: float = 10.0, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` with text output captured and a timeout; a failure says what ran."""
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, input=input)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r


def daemon_env(**extra: str) -> dict:
    """The environment daemons start with: this one, less conftest's session mark (what a
    daemon leaves behind is found by the namespace check instead)."""
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}
    env.update(extra)
    return env


def describe(pids: Sequence[int]) -> str:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"pid {pid} ({p.status()}): {' '.join(p.cmdline())[:200] or p.name()}")
        except psutil.Error:
            out.append(f"pid {pid} (gone)")
    return "\n".join(out)


def _skip_unless(*paths_or_cmds: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root (network namespaces and daemons)")
    for what in ("ip", "unshare", *paths_or_cmds):
        if not (os.access(what, os.X_OK) if os.path.isabs(what) else shutil.which(what)):
            pytest.skip(f"{what} is not installed ({PKG_HINT})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait(what: str, cond, timeout: float, logs: Sequence[str] = (), interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            text = "".join(f"\n--- {path}:\n{_tail(path)}" for path in logs)
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}{text}")
        time.sleep(interval)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"({e})"


def _reachable(addr: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In a daemon, between fork and exec: SIGKILL it when the test process ends, even
    killed before its teardown (the signal is kept across exec of non-setuid programs)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _popen(argv: Sequence[str], log, env: dict) -> subprocess.Popen:
    """Start a daemon in a session of its own, output to ``log``, dying with us."""
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)


def _stop(procs: Sequence[subprocess.Popen], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``, and reap."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


# ------------------------------------------------------------------------- the network


@contextlib.contextmanager
def _networks_lock() -> Iterator[None]:
    """Held while a network is swept for, given its subnet and its bridge (every test process
    of this machine, every pytest session: a file lock)."""
    os.makedirs(OWNERS, exist_ok=True)
    fd = os.open(f"{OWNERS}/.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class Network:
    """A bridge in the root namespace (``<subnet>.1``) and one namespace per host
    (``<subnet>.11``, ``.12``, ...), each joined to it by a veth pair.  Each namespace has
    its own ``/etc/hosts`` (every host's name, and the controller's hostname and
    ``mk-controller`` at the bridge's address) and a ``resolv.conf`` that fails at once, so
    looking up an unknown name never waits for DNS; ``spawn`` mounts them over /etc's."""

    kind: str  # one letter, in the interface names: "s" (ssh), "n" (slurm nodes)
    names: list[str]  # the hosts' hostnames
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: str = ""
    namespaces: list[str] = field(default_factory=list)
    ips: list[str] = field(default_factory=list)
    cut_hosts: set[str] = field(default_factory=set)
    etc: str = ""  # the hosts' hosts and resolv.conf
    empty: str = ""  # an empty folder, mounted over the folders a host must not see

    @property
    def bridge(self) -> str:
        return f"mk{self.kind}b{self.tag}"

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.1"

    def veth(self, i: int) -> str:
        return f"mk{self.kind}v{self.tag}{i}"

    def index(self, host: str) -> int:
        """The host's index, given its IP, hostname or namespace name."""
        for seq in (self.ips, self.names, self.namespaces):
            if host in seq:
                return seq.index(host)
        raise KeyError(f"{host!r} is none of this network's hosts {self.ips} ({self.names})")

    @property
    def _owner_file(self) -> str:
        return f"{OWNERS}/{self.kind}{self.tag}.json"

    def _own(self) -> None:
        """Record what this network is and who made it, for ``sweep``."""
        me = psutil.Process()
        with open(self._owner_file, "w") as f:
            json.dump({"pid": me.pid, "started": me.create_time(), "bridge": self.bridge,
                       "namespaces": [f"{name}-{self.tag}" for name in self.names]}, f)

    @staticmethod
    def sweep() -> None:
        """Delete the namespaces and bridges of networks whose maker is gone (a pytest
        killed before its teardown); its daemons died with it."""
        os.makedirs(OWNERS, exist_ok=True)
        for name in os.listdir(OWNERS):
            if name.startswith("."):
                continue  # the makers' lock
            path = f"{OWNERS}/{name}"
            try:
                with open(path) as f:
                    rec = json.load(f)
                alive = psutil.Process(rec["pid"]).create_time() == rec["started"]
            except psutil.NoSuchProcess:
                alive = False
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours
            if alive:
                continue
            for ns in rec["namespaces"]:
                run(["ip", "netns", "delete", ns], check=False)
            run(["ip", "link", "delete", rec["bridge"]], check=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def create(self, etc: str) -> None:
        """Make the bridge, the namespaces and their veth pairs, and write each host's
        hosts/resolv.conf under ``etc``."""
        # One maker at a time picks a subnet and claims it with its bridge's address: two test
        # workers picking at once could take the same free subnet, and each would reach the
        # other's hosts (an ssh that times out in its banner exchange); nor may a sweep run
        # while another maker is half done.
        with _networks_lock():
            self.sweep()
            self._own()
            used = run(["ip", "-4", "-o", "addr"]).stdout + run(["ip", "-4", "route"]).stdout
            free = [x for x in range(1, 255) if f"10.77.{x}." not in used]
            if not free:
                raise RuntimeError("no free 10.77.x.0/24 subnet for the test network")
            self.subnet = f"10.77.{free[secrets.randbelow(len(free))]}"
            # nf_call_*tables 0: host-to-host frames skip br_netfilter (bridge-nf-call-iptables is
            # 1 by default), so no iptables FORWARD rule of this machine's can drop them.
            run(["ip", "link", "add", self.bridge, "type", "bridge", "nf_call_iptables", "0", "nf_call_ip6tables",
                 "0", "nf_call_arptables", "0"], timeout=60)
            run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge], timeout=60)
        self.etc = etc
        run(["ip", "link", "set", self.bridge, "up"], timeout=60)
        controller = socket.gethostname()
        hosts = [f"{self.subnet}.{11 + i} {name}" for i, name in enumerate(self.names)]
        with open(f"{etc}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{self.bridge_ip} {controller} mk-controller\n" + "\n".join(hosts) + "\n")
        with open(f"{etc}/resolv.conf", "w") as f:
            f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for i, name in enumerate(self.names):
            ns, ip = f"{name}-{self.tag}", f"{self.subnet}.{11 + i}"
            run(["ip", "netns", "add", ns], timeout=60)
            self.namespaces.append(ns)
            self.ips.append(ip)
            for cmd in (["link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns],
                        ["link", "set", self.veth(i), "master", self.bridge, "up"],
                        ["-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0"],
                        ["-n", ns, "link", "set", "eth0", "up"],
                        ["-n", ns, "link", "set", "lo", "up"],
                        ["-n", ns, "route", "add", "default", "via", self.bridge_ip]):
                run(["ip", *cmd], timeout=60)  # a loaded machine's netlink can be slow: 10 s was too short once

    # Not `ip netns exec`: that mounts a fresh /sys, which hides /sys/fs/cgroup, and slurmd
    # 22.05 will not start without its cgroup plugin.  The host's own mount namespace only
    # bind-mounts its hosts and resolv.conf over /etc's (private: nothing shows outside).
    # With ``SHM_SIZE`` set, the host also gets a /dev/shm of its own (a tmpfs of that size),
    # so filling it leaves the machine's, and the other hosts', alone.
    SPAWN = ('hostname "$1" && shift && for f in hosts resolv.conf; do if [ -e "/etc/$f" ]; then '
             'mount --bind "$ETC_DIR/$f" "/etc/$f" || exit 1; fi; done && '
             'if [ -n "$SHM_SIZE" ]; then mount -t tmpfs -o "size=$SHM_SIZE,mode=1777" tmpfs /dev/shm || exit 1; fi && '
             'IFS=: && for d in $HIDE_DIRS; do '
             'if [ -d "$d" ]; then mount --bind "$EMPTY_DIR" "$d" || exit 1; fi; done && '
             'unset IFS ETC_DIR SHM_SIZE HIDE_DIRS EMPTY_DIR && exec "$@"')

    def spawn(self, i: int, argv: Sequence[str], log: str, env: dict | None = None,
              shm_size: str | None = None, hide: Sequence[str] = ()) -> subprocess.Popen:
        """Start ``argv`` in host i's namespace under its own hostname, with its own
        /etc/hosts (and, given ``shm_size`` such as ``"256m"``, its own /dev/shm; given
        ``hide``, those folders seen empty there); it keeps the pid of the Popen (nsenter and
        unshare exec into it)."""
        cmd = ["nsenter", f"--net=/run/netns/{self.namespaces[i]}", "unshare", "--uts", "--mount", "--",
               "sh", "-c", self.SPAWN, "sh", self.names[i], *argv]
        with open(log, "ab") as out:
            return _popen(cmd, out, {**(env or daemon_env()), "ETC_DIR": self.etc, "SHM_SIZE": shm_size or "",
                                     "HIDE_DIRS": ":".join(hide), "EMPTY_DIR": self.empty})

    def pids(self, i: int) -> list[int]:
        r = run(["ip", "netns", "pids", self.namespaces[i]], check=False)
        return sorted(int(x) for x in r.stdout.split())

    def cut(self, host: str) -> None:
        i = self.index(host)
        run(["ip", "link", "set", self.veth(i), "down"])
        self.cut_hosts.add(self.ips[i])

    def restore(self, host: str) -> None:
        i = self.index(host)
        run(["ip", "link", "set", self.veth(i), "up"])
        self.cut_hosts.discard(self.ips[i])
        ns = self.namespaces[i]
        _wait(f"{ns}'s link to come back", lambda: "LOWER_UP" in run(["ip", "-n", ns, "link", "show", "eth0"]).stdout,
              5.0)

    def restore_all(self) -> None:
        for ip in list(self.cut_hosts):
            self.restore(ip)

    def leftovers(self, keep: set[int], grace: float) -> dict[str, str]:
        """Processes in the namespaces other than ``keep`` that are still alive after
        ``grace`` seconds (zombies count as gone): SIGKILLed, and described (pid, state,
        command line) by namespace."""

        def alive() -> dict[str, list[int]]:
            found = {}
            for i, ns in enumerate(self.namespaces):
                pids = []
                for pid in self.pids(i):
                    if pid in keep:
                        continue
                    try:
                        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                            pids.append(pid)
                    except psutil.Error:
                        pass
                if pids:
                    found[ns] = pids
            return found

        deadline = time.monotonic() + grace
        left = alive()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = alive()
        # Writers (they end once they have converted) and processes already in their exit
        # (a loaded machine takes a while to tear down a large one) are given longer.
        deadline = time.monotonic() + WRITER_GRACE_S
        while left and all(is_history_writer(pid) or is_exiting(pid) for pids in left.values() for pid in pids) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
            left = alive()
        # Described while they are alive (afterwards there is nothing to read), then one more
        # look: a process that ends of itself now was slow to go on a loaded machine, not left.
        said = {pid: describe([pid]) for pids in left.values() for pid in pids}
        deadline = time.monotonic() + LATE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = alive()
        self._kill([pid for pids in left.values() for pid in pids])
        return {ns: "\n".join(said.get(pid, describe([pid])) for pid in pids) for ns, pids in left.items()}

    @staticmethod
    def _kill(pids: Sequence[int]) -> None:
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.kill()
                procs.append(p)
        psutil.wait_procs(procs, timeout=5)

    def kill_all(self) -> None:
        self._kill([pid for i in range(len(self.namespaces)) for pid in self.pids(i)])

    def destroy(self) -> None:
        for ns in self.namespaces:
            run(["ip", "netns", "delete", ns], check=False)  # takes its veth pair with it
        run(["ip", "link", "delete", self.bridge], check=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._owner_file)


def _check(cluster) -> str:
    """``cluster.check_clean()``'s report, or what made it fail; "" for no cluster."""
    if cluster is None:
        return ""
    try:
        return cluster.check_clean()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"


def _report(report: str, failed: bool) -> None:
    """At teardown: raise what was left, unless an error is already on its way out (it is
    printed then, not raised over that error)."""
    if report and failed:
        print(report, file=sys.stderr)
    elif report:
        raise RuntimeError(report)


def is_history_writer(p: psutil.Process | int) -> bool:
    """Whether ``p`` is a history writer process (``monarch_kernel.history.writer_process``)."""
    try:
        p = psutil.Process(p) if isinstance(p, int) else p
        return "monarch_kernel.history.writer_process" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def is_exiting(pid: int) -> bool:
    """Whether ``pid`` is past the point of no return in its exit: its memory is gone (an
    empty command line, which only kernel threads have otherwise, and none live in a test's
    namespace), so it runs no more code of its own."""
    try:
        p = psutil.Process(pid)
        return not p.cmdline() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _leak_report(left: dict[str, str], what: str) -> str:
    return f"processes left on {what} after the test (killed now):\n" + "\n".join(
        f"[{ns}]\n{text}" for ns, text in left.items())


# ------------------------------------------------------------------------- ssh hosts


@dataclass
class SSHHosts:
    """Hosts reachable with ``ssh *ssh_args HOST CMD`` as root.

    ``hosts``: their IPs (``10.77.x.11``, ``.12``); ``names``: their hostnames (``mk-h1``,
    ``mk-h2``: what ``socket.gethostname()`` says there, resolvable on every host);
    ``controller_ip``: the bridge's address, at which the hosts reach the root namespace
    (the controller's own hostname and ``mk-controller`` resolve to it on the hosts);
    ``key`` / ``wrong_key``: private keys that sshd accepts / refuses; ``ssh_args``: ssh's
    options (key, no host-key checks or known_hosts, batch mode, no user config, short
    connect timeout, generous for a loaded machine); ``ssh_args_for(key)`` the same with another key."""

    net: Network
    key: str
    wrong_key: str
    sshd: list[subprocess.Popen]
    logs: list[str]
    user: str = "root"

    @property
    def hosts(self) -> list[str]:
        return list(self.net.ips)

    @property
    def names(self) -> list[str]:
        return list(self.net.names)

    @property
    def controller_ip(self) -> str:
        return self.net.bridge_ip

    def ssh_args_for(self, key: str) -> tuple[str, ...]:
        return ("-F", "/dev/null", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=20", "-l", self.user)

    @property
    def ssh_args(self) -> tuple[str, ...]:
        return self.ssh_args_for(self.key)

    def ssh(self, host: str, command: str, *, timeout: float = 20.0, key: str | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` on ``host`` through ssh and return what it did (not checked)."""
        return run(["ssh", *self.ssh_args_for(key or self.key), host, command], timeout=timeout, check=False,
                   input=input)

    def netns(self, host: str) -> str:
        """The network namespace of ``host`` (its IP or hostname)."""
        return self.net.namespaces[self.net.index(host)]

    def ip(self, host: str) -> str:
        return self.net.ips[self.net.index(host)]

    def cut(self, host: str) -> None:
        """Take the host's link down (its veth on the bridge): packets to and from it are
        dropped, as on a cut cable; its processes keep running.  Restored after the test."""
        self.net.cut(host)

    def restore(self, host: str) -> None:
        self.net.restore(host)

    def in_host(self, host: str, command: str, *, timeout: float = 20.0) -> subprocess.CompletedProcess:
        """Run the shell ``command`` as root in the host's namespaces (its network and its
        mounts: its own /dev/shm, when it has one) without ssh; not checked."""
        pid = self.sshd[self.net.index(host)].pid
        return run(["nsenter", "-t", str(pid), "-n", "-m", "-u", "--", "sh", "-c", command], timeout=timeout,
                   check=False)

    def pids(self, host: str, *, sshd_sessions: bool = False) -> list[int]:
        """Pids of the processes in the host's namespace, other than its sshd (the
        listener, and unless ``sshd_sessions`` also its per-connection children)."""
        i = self.net.index(host)
        out = []
        for pid in self.net.pids(i):
            if pid == self.sshd[i].pid:
                continue
            if not sshd_sessions:
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).name() == "sshd":  # its name stays readable while it exits
                        continue
            out.append(pid)
        return out

    def check_clean(self, grace: float = GRACE_S) -> str:
        """Restore cut links; then "" if only the sshd listeners are left in the
        namespaces (within ``grace`` s), or else what was left (it is killed)."""
        self.net.restore_all()
        dead = [i for i, p in enumerate(self.sshd) if p.poll() is not None]
        if dead:
            raise RuntimeError("sshd exited:" + "".join(f"\n--- {self.logs[i]}:\n{_tail(self.logs[i])}" for i in dead))
        left = self.net.leftovers({p.pid for p in self.sshd}, grace)
        return _leak_report(left, "the ssh hosts") if left else ""


SSHD_CONFIG = """\
Port 22
ListenAddress {ip}
HostKey {dir}/host_key
PidFile {dir}/sshd-{name}.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
MaxStartups 200
MaxSessions 200
AcceptEnv MONARCH_*
Subsystem sftp internal-sftp
"""


@contextlib.contextmanager
def ssh_network(n: int = 2, shm_size: str | None = None, hide: Sequence[str] = (),
                sshd_extra: str = "") -> Iterator[SSHHosts]:
    """``n`` hosts with sshd (see ``SSHHosts``); everything is removed on exit, and what is
    still running in their namespaces then raises (after being killed).  ``shm_size``
    (``"256m"``): each host gets a /dev/shm of its own, of that size (``SSHHosts.in_host``
    runs a command where it is seen); by default they share the machine's.  ``hide``:
    folders that are empty on the hosts (the controller's Python environment, for
    ``sync_env``), each an empty folder mounted over it in sshd's mount namespace.
    ``sshd_extra``: more lines for sshd_config (``SetEnv ...``)."""
    _skip_unless(SSHD, "ssh", "ssh-keygen")
    tmp = tempfile.mkdtemp(prefix="mk-ssh-")
    net = Network("s", [f"mk-h{i + 1}" for i in range(n)])
    sshd: list[subprocess.Popen] = []
    hosts, failed = None, False
    try:
        for name in ("host_key", "id_ed25519", "wrong_ed25519"):
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"monarch-kernel-test-{name}",
                 "-f", f"{tmp}/{name}"])
        shutil.copy(f"{tmp}/id_ed25519.pub", f"{tmp}/authorized_keys")
        net.empty = f"{tmp}/empty"
        os.mkdir(net.empty, 0o755)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        net.create(tmp)
        logs = []
        for i, (name, ip) in enumerate(zip(net.names, net.ips, strict=True)):
            cfg = f"{tmp}/sshd_config-{name}"
            with open(cfg, "w") as f:
                f.write(SSHD_CONFIG.format(ip=ip, dir=tmp, name=name) + sshd_extra)
            run([SSHD, "-t", "-f", cfg])
            logs.append(f"{tmp}/sshd-{name}.log")
            sshd.append(net.spawn(i, [SSHD, "-D", "-e", "-f", cfg], logs[i], shm_size=shm_size, hide=hide))
        hosts = SSHHosts(net, f"{tmp}/id_ed25519", f"{tmp}/wrong_ed25519", sshd, logs)
        for ip, log in zip(net.ips, logs, strict=True):
            _wait(f"sshd on {ip}:22", lambda ip=ip: _reachable(ip, 22), 10.0, [log])
        yield hosts
    except BaseException:
        failed = True
        raise
    finally:
        report = _check(hosts)
        _stop(sshd)
        net.kill_all()
        net.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
        _report(report, failed)


@contextlib.contextmanager
def walled_network() -> Iterator[SSHHosts]:
    """Three ssh hosts: a login node and two compute hosts, which have no route to the test
    process (the laptop): every packet they send it is refused, so the laptop reaches them
    only through the login node, and they cannot open a connection back."""
    with ssh_network(3) as hosts:
        for ns in (hosts.netns(h) for h in hosts.hosts[1:]):
            run(["ip", "-n", ns, "route", "del", "default"])  # nothing beyond the cluster's subnet
            run(["ip", "-n", ns, "route", "add", "prohibit", f"{hosts.controller_ip}/32"])
        yield hosts


def ssh_config_file(hosts: SSHHosts, path: str, entries: str) -> str:
    """An ssh configuration file at ``path``: ``entries``, then the test hosts' key and
    options for all; returns ``path``."""
    with open(path, "w") as f:
        f.write(entries + f"""
Host *
  User {hosts.user}
  IdentityFile {hosts.key}
  IdentitiesOnly yes
  IdentityAgent none
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 20
""")
    return path


def walled_ssh_config(hosts: SSHHosts, path: str) -> str:
    """``walled_network``'s names: ``login``, and ``gpu1``/``gpu2`` reached through it."""
    login, c1, c2 = hosts.hosts
    return ssh_config_file(hosts, path, f"Host login\n  HostName {login}\nHost gpu*\n  ProxyJump login\n"
                                        f"Host gpu1\n  HostName {c1}\nHost gpu2\n  HostName {c2}\n")


def checkout_python(folder: str) -> str:
    """An interpreter, written into ``folder``, with this checkout first on its path (so
    agents on the ssh hosts run the code under test)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexport PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}\nexec {sys.executable} "$@"\n')
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="session")
def ssh_hosts_session() -> Iterator[SSHHosts]:
    """The session's ssh hosts (built on first use, in about a second)."""
    with ssh_network() as hosts:
        yield hosts


@pytest.fixture
def ssh_hosts(ssh_hosts_session: SSHHosts) -> Iterator[SSHHosts]:
    """The session's ssh hosts, checked after the test: cut links are restored, and a
    process still running on a host after ``GRACE_S`` seconds fails the test."""
    yield ssh_hosts_session
    report = ssh_hosts_session.check_clean()
    if report:
        pytest.fail(report, pytrace=False)


@pytest.fixture(scope="session")
def ssh_bare_hosts() -> Iterator[SSHHosts]:
    """One ssh host on which this controller's Python environment (every sys.path folder
    outside the standard library: the .venv's site-packages, this checkout) is empty folders,
    as on a machine without the notebook's packages; for ``sync_env``.  Session scope, as the
    others: the controller listens on a bridge's address once, which must outlive the test."""
    from monarch_kernel.job.env_sync import roots

    with ssh_network(1, hide=[path for path, _kind, _only in roots()]) as hosts:
        yield hosts


# ------------------------------------------------------------------------- slurm


SLURM_CONF = """\
ClusterName=mk{tag}
SlurmctldHost={controller}({controller_ip})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=2
KillWait=2
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=30
TmpFS={dir}/tmp
{nodes}
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@dataclass
class SlurmCluster:
    """A Slurm cluster whose nodes are network namespaces.

    ``nodes``: node names (``mkn1``, ``mkn2``: also each node's hostname, which is what
    ``hostname`` and ``$SLURMD_NODENAME`` say in a job there); ``node_ips``: name -> IP
    (``10.77.x.11``, ...); ``controller_ip``: the bridge's address (slurmctld's, and where
    jobs reach the root namespace); ``cpus``: CPUs per node; ``partition``: the default
    partition; ``env``: this process's environment plus ``SLURM_CONF`` (and
    ``SBATCH_OUTPUT``: batch jobs write ``slurm-<id>.out`` under ``output_dir``, not in the
    working directory), for the clients; ``conf``: slurm.conf's path."""

    net: Network
    conf: str
    dir: str
    cpus: int
    partition: str
    daemons: dict[str, subprocess.Popen]  # "munged", "slurmctld", "slurmd-<node>"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def nodes(self) -> list[str]:
        return list(self.net.names)

    @property
    def node_ips(self) -> dict[str, str]:
        return dict(zip(self.net.names, self.net.ips, strict=True))

    @property
    def controller_ip(self) -> str:
        return self.net.bridge_ip

    @property
    def output_dir(self) -> str:
        return f"{self.dir}/jobs"

    def netns(self, node: str) -> str:
        return self.net.namespaces[self.net.index(node)]

    def cut(self, node: str) -> None:
        """Take the node's link down (see ``SSHHosts.cut``); restored after the test."""
        self.net.cut(node)

    def restore(self, node: str) -> None:
        self.net.restore(node)

    def run(self, *argv: str, timeout: float = 20.0, check: bool = True, input: str | None = None):
        """Run a Slurm client (``srun``, ``sbatch`` ...) against this cluster."""
        return run(argv, timeout=timeout, check=check, env=self.env, input=input)

    def squeue_json(self) -> dict:
        """``squeue --json``, parsed (Slurm 22.05's layout: see tests/fixtures/)."""
        return json.loads(self.run("squeue", "--json").stdout)

    def jobs(self) -> list[dict]:
        """The jobs slurmctld still lists as pending, running or completing: dicts with
        ``job_id``, ``state`` and ``nodes`` (from ``squeue``'s plain output)."""
        out = self.run("squeue", "-h", "-t", "PD,R,CG,CF,S,RQ,RS,SO,ST", "-o", "%i|%T|%N").stdout
        return [dict(zip(("job_id", "state", "nodes"), line.split("|"), strict=True))
                for line in out.splitlines() if line.strip()]

    def pids(self, node: str) -> list[int]:
        """Pids in the node's namespace other than its slurmd (slurmstepd, job tasks)."""
        i = self.net.index(node)
        return [p for p in self.net.pids(i) if p != self.daemons[f"slurmd-{node}"].pid]

    def wait_idle(self, timeout: float = 20.0) -> None:
        def idle() -> bool:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes)

        logs = [f"{self.dir}/slurmctld.log"] + [f"{self.dir}/slurmd-{n}.log" for n in self.nodes]
        _wait("the Slurm nodes to be up", idle, timeout, logs, interval=0.2)

    def check_clean(self, grace: float = GRACE_S) -> str:
        """Restore cut links, cancel jobs left queued and wait for their processes; "" when
        the test left nothing, or else what it left (cancelled and killed by now)."""
        self.net.restore_all()
        dead = [name for name, p in self.daemons.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"Slurm daemons exited: {dead}; logs in {self.dir}")
        problems = []
        jobs, deadline = self.jobs(), time.monotonic() + grace
        while any(j["state"] == "COMPLETING" for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.1)  # ending: srun returns before its job has finished completing
            jobs = self.jobs()
        if jobs:
            problems.append(f"Slurm jobs left after the test (cancelled now): {jobs}")
            self.run("scancel", *[j["job_id"] for j in jobs], check=False)
            with contextlib.suppress(RuntimeError):
                _wait("cancelled jobs to leave squeue", lambda: not self.jobs(), 15.0, interval=0.2)
        keep = {p.pid for p in self.daemons.values()}
        left = self.net.leftovers(keep, grace)
        if left:
            problems.append(_leak_report(left, "the Slurm nodes"))
        return "\n".join(problems)


@contextlib.contextmanager
def slurm_network(n: int = 2, cpus: int = 4) -> Iterator[SlurmCluster]:
    """munged + slurmctld (root namespace) + ``n`` slurmd nodes of ``cpus`` CPUs each
    (config_overrides: they need not exist); torn down on exit, raising if anything was
    still running on a node."""
    _skip_unless(*SLURM_DAEMONS, *SLURM_CLIENTS)
    tmp = tempfile.mkdtemp(prefix="mk-slurm-")
    os.chmod(tmp, 0o711)  # munged wants its socket's directory searchable by all
    net = Network("n", [f"mkn{i + 1}" for i in range(n)])
    daemons: dict[str, subprocess.Popen] = {}
    cluster, failed = None, False
    try:
        for sub in ("state", "tmp", "jobs", *[f"spool-{name}" for name in net.names]):
            os.makedirs(f"{tmp}/{sub}")
        with open(f"{tmp}/munge.key", "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(f"{tmp}/munge.key", 0o400)
        open(f"{tmp}/plugstack.conf", "w").close()
        net.create(tmp)
        nodes = "\n".join(f"NodeName={name} NodeAddr={ip} NodeHostname={name} CPUs={cpus} State=UNKNOWN"
                          for name, ip in zip(net.names, net.ips, strict=True))
        conf = f"{tmp}/slurm.conf"
        with open(conf, "w") as f:
            f.write(SLURM_CONF.format(tag=net.tag, controller=socket.gethostname().split(".")[0],
                                      controller_ip=net.bridge_ip, ctld_port=_free_port(), slurmd_port=_free_port(),
                                      dir=tmp, nodes=nodes, partition="mk"))
        env = daemon_env(SLURM_CONF=conf)
        with open(f"{tmp}/munged.log", "ab") as log:
            daemons["munged"] = _popen(
                ["/usr/sbin/munged", "-F", "-f", f"--socket={tmp}/munge.socket", f"--key-file={tmp}/munge.key",
                 f"--pid-file={tmp}/munged.pid", f"--seed-file={tmp}/munged.seed", f"--log-file={tmp}/munged.log"],
                log, env)
        _wait("munged's socket", lambda: os.path.exists(f"{tmp}/munge.socket"), 10.0, [f"{tmp}/munged.log"])
        with open(f"{tmp}/slurmctld.out", "ab") as log:
            daemons["slurmctld"] = _popen(["/usr/sbin/slurmctld", "-D", "-i", "-f", conf], log, env)
        for i, name in enumerate(net.names):
            daemons[f"slurmd-{name}"] = net.spawn(i, ["/usr/sbin/slurmd", "-D", "-f", conf], f"{tmp}/slurmd-{name}.out",
                                                  env=env)
        cluster = SlurmCluster(net, conf, tmp, cpus, "mk", daemons,
                               env={**os.environ, "SLURM_CONF": conf, "SBATCH_OUTPUT": f"{tmp}/jobs/slurm-%j.out"})
        cluster.wait_idle()
        yield cluster
    except BaseException:
        failed = True
        raise
    finally:
        report = _check(cluster)
        _stop([p for name, p in daemons.items() if name.startswith("slurmd")])
        _stop([daemons[name] for name in ("slurmctld", "munged") if name in daemons])
        net.kill_all()
        net.destroy()
        shutil.rmtree(tmp, ignore_errors=True)
        _report(report, failed)


@pytest.fixture(scope="session")
def slurm_cluster_session() -> Iterator[SlurmCluster]:
    """The session's Slurm cluster (built on first use)."""
    with slurm_network() as cluster:
        yield cluster


@pytest.fixture
def slurm_cluster(slurm_cluster_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster, checked after the test: a job still queued, or a
    process still running on a node after ``GRACE_S`` seconds, fails the test."""
    yield slurm_cluster_session
    report = slurm_cluster_session.check_clean()
    if report:
        pytest.fail(report, pytrace=False)


@contextlib.contextmanager
def veth_namespace(kind: str, subnet_base: int = 200) -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: another host on a /24 of its
    own (``10.<subnet_base + 0..49>.<0..255>``).  Yields (namespace, this host's address
    there, the namespace's address); the namespace, and its veth pair with it, go at the end.
    The caller checks for root and iproute2 first."""
    tag = os.urandom(3).hex()
    ns = f"mk-{kind}-{tag}"
    net = f"10.{subnet_base + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    here, there = f"h{kind[:3]}{tag}", f"n{kind[:3]}{tag}"
    run(["ip", "netns", "add", ns], timeout=20)
    try:
        run(["ip", "-n", ns, "link", "set", "lo", "up"], timeout=20)
        run(["ip", "link", "add", here, "type", "veth", "peer", "name", there, "netns", ns], timeout=20)
        run(["ip", "addr", "add", f"{net}.1/24", "dev", here], timeout=20)
        run(["ip", "link", "set", here, "up"], timeout=20)
        run(["ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", there], timeout=20)
        run(["ip", "-n", ns, "link", "set", there, "up"], timeout=20)
        yield ns, f"{net}.1", f"{net}.2"
    finally:
        run(["ip", "netns", "delete", ns], timeout=20, check=False)


@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair: a host of its own, whose
    loopback this process cannot reach.  Yields (namespace, its address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace (`make test` installs iproute2)")
    with veth_namespace("dbg", 200) as (ns, here, there):
        yield ns, there


@dataclass
class SlurmLogin:
    """A login node of a ``SlurmCluster``, for a controller outside it (this process: a laptop).

    ``hosts``: the login node as an ssh host (``hosts.hosts[0]``, on a network of its own with
    this process); ``cluster_ip``: its second address, on the cluster's bridge; ``laptop_ip``:
    this process's address on the login network.  The cluster's nodes have no route to that
    network; the login node forwards nothing between its two."""

    hosts: SSHHosts
    cluster: SlurmCluster
    cluster_ip: str

    @property
    def login(self) -> str:
        return f"{self.hosts.user}@{self.hosts.hosts[0]}"

    @property
    def laptop_ip(self) -> str:
        return self.hosts.controller_ip

    def pids(self) -> list[int]:
        """The login node's processes other than its sshd listener (relays, sruns, sessions)."""
        return self.hosts.pids(self.hosts.hosts[0], sshd_sessions=True)


@contextlib.contextmanager
def slurm_login(cluster: SlurmCluster) -> Iterator[SlurmLogin]:
    """A login namespace running sshd for ``cluster``: Slurm's clients work there (its sshd sets
    SLURM_CONF; munge's socket and slurm.conf are on the shared file system), it has a second
    interface on the cluster's bridge, and the nodes get a ``prohibit`` route to the login
    network (this process's address there), removed on exit with the second interface."""
    with ssh_network(1, sshd_extra=f"SetEnv SLURM_CONF={cluster.conf}\n") as hosts:
        ns = hosts.netns(hosts.hosts[0])
        veth = f"mklv{hosts.net.tag}"
        used = {ip for ip in cluster.net.ips}
        ip = next(f"{cluster.net.subnet}.{x}" for x in range(250, 200, -1) if f"{cluster.net.subnet}.{x}" not in used)
        walled = f"{hosts.net.subnet}.0/24"
        try:
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth1", "netns", ns])
            run(["ip", "link", "set", veth, "master", cluster.net.bridge, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth1"])
            run(["ip", "-n", ns, "link", "set", "eth1", "up"])
            for node_ns in cluster.net.namespaces:
                run(["ip", "-n", node_ns, "route", "add", "prohibit", walled])
            yield SlurmLogin(hosts, cluster, ip)
        finally:
            for node_ns in cluster.net.namespaces:
                run(["ip", "-n", node_ns, "route", "del", "prohibit", walled], check=False)
            run(["ip", "link", "delete", veth], check=False)


_HOLD = ("import socket, sys\ns = socket.socket()\ns.bind(('0.0.0.0', int(sys.argv[1])))\ns.listen()\n"
         "print('held', flush=True)\nsys.stdin.read()")


def port_thief_cell(ns: str, job: str, hosts: str) -> str:
    """A notebook cell for a controller whose ports are forwarded to the same ports of another
    host (the namespace ``ns``), where another program takes the next one: ``job`` (statements
    that make the job ``mine``) starts with a listen hook of the cell's before the job's own,
    which, once the job is up, takes each new port's number in ``ns`` (a listener on every
    address) before the job's hook forwards it; then a new thread's call (a new reply inbox, a
    new port) must still answer.  It prints ``RESULT`` and JSON: ``held`` [(port, 'held')],
    ``host`` (that call's answer: the rank's hostname), ``ports`` (the controller's then)."""
    return f"""
import json, socket, subprocess, sys, threading
from monarch_kernel import Actor, endpoint
from monarch_kernel.runtime import Runtime

class Where(Actor):
    @endpoint
    def host(self) -> str:
        return socket.gethostname()

held, armed, box = [], [], {{}}

def occupy(address):
    if armed and not held:  # the first port the controller opens once the job is up
        port = int(address.rsplit(":", 1)[1])
        p = subprocess.Popen(["ip", "netns", "exec", {ns!r}, sys.executable, "-c", {_HOLD!r}, str(port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        held.append((port, p, p.stdout.readline().strip()))

unhook = Runtime.current().on_listen(occupy)  # before the job's: it hears each port first
{job}
try:
    m = {hosts}.spawn_procs(per_host={{"gpus": 1}}).spawn("where", Where)
    m.host.call_one().get(timeout=30)
    armed.append(1)
    t = threading.Thread(target=lambda: box.update(host=m.host.call_one().get(timeout=30)))
    t.start()
    t.join(60)
    ports = [int(a.rsplit(":", 1)[1]) for a in Runtime.current().tcp_addresses()]
finally:
    unhook()
    for _port, p, _state in held:
        p.stdin.close()
        p.wait(10)
    mine.kill()
print("RESULT " + json.dumps(dict(held=[(port, state) for port, _p, state in held], host=box.get("host"),
                                   ports=ports)))
"""

