"""The faults the chaos run (chaos.py) injects, each with its undoing: a rank SIGKILLed, a
rank SIGSTOPped and later SIGCONTed, a host's agent SIGKILLed, a host's link down and up,
a host's /dev/shm filled (each simulated host has its own), a rank's descriptors exhausted
(its soft RLIMIT_NOFILE lowered to what it has open), and a burst of garbage connections to
every port that the run's processes listen on.  Never touches a process that is not the
run's: other programs on the machine are left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from ._util import log

KINDS = ("sigkill_rank", "sigstop_rank", "kill_agent", "link_down", "shm_full", "fds_exhausted", "garbage")

# Run in a host's namespace (or here, with pids to keep to): connect to every listening TCP
# port of the given processes, send random bytes of random sizes, hang up.
GARBAGE = r"""
import os, random, socket, sys
import psutil
rng = random.Random(int(sys.argv[1]))
only = {int(p) for p in sys.argv[2].split(",") if p}
ports = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port != 22 and (not only or c.pid in only)})
n = 0
for ip, port in ports:
    for _ in range(6):
        try:
            with socket.create_connection(("127.0.0.1" if ip in ("0.0.0.0", "::") else ip, port), timeout=1) as s:
                s.settimeout(1)
                if rng.random() < 0.8:
                    s.sendall(os.urandom(rng.choice((1, 10, 64, 1000, 70000))))
                n += 1
        except OSError:
            pass
print(len(ports), n)
"""


class Faults:
    """Injects faults on the run's processes: ``net`` the simulated hosts (cluster.py's
    ``SSHHosts``), ``rank_pids()`` the pids of every rank now (hosts' and kernel's),
    ``local_pids()`` the run's processes in the root namespace (controller, kernel, their
    ranks)."""

    def __init__(self, net, rank_pids, local_pids, rng):
        self.net, self.rank_pids, self.local_pids, self.rng = net, rank_pids, local_pids, rng

    def inject(self, kind: str) -> tuple[str, object]:
        """Start fault ``kind``; (what it hit, the state its undoing needs)."""
        return getattr(self, f"_{kind}")()

    def undo(self, kind: str, state) -> None:
        fn = getattr(self, f"_undo_{kind}", None)
        if fn is not None:
            fn(state)

    def _pick_rank(self) -> int | None:
        pids = [p for p in self.rank_pids() if p]
        return pids[self.rng.randrange(len(pids))] if pids else None

    def _pick_host(self) -> str:
        return self.net.hosts[self.rng.randrange(len(self.net.hosts))]

    def _sigkill_rank(self):
        pid = self._pick_rank()
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGKILL)
        return f"pid {pid}", pid

    def _sigstop_rank(self):
        pid = self._pick_rank()
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGSTOP)
        return f"pid {pid}", pid

    def _undo_sigstop_rank(self, pid) -> None:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGCONT)

    def _kill_agent(self):
        host = self._pick_host()
        for pid in self.net.pids(host):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGKILL)
                    return f"agent {pid} on {host}", host
        return f"no agent on {host}", host

    def _link_down(self):
        host = self._pick_host()
        self.net.cut(host)
        return f"link of {host}", host

    def _undo_link_down(self, host) -> None:
        self.net.restore(host)

    def _shm_full(self):
        host = self._pick_host()
        self.net.in_host(host, "cat /dev/zero > /dev/shm/chaos-fill 2>/dev/null; true", timeout=60)
        left = self.net.in_host(host, "df -k --output=avail /dev/shm | tail -1").stdout.strip()
        return f"/dev/shm of {host} ({left} KiB left)", host

    def _undo_shm_full(self, host) -> None:
        self.net.in_host(host, "rm -f /dev/shm/chaos-fill")

    def _fds_exhausted(self):
        pid = self._pick_rank()
        try:
            p = psutil.Process(pid)
            old = p.rlimit(psutil.RLIMIT_NOFILE)
            p.rlimit(psutil.RLIMIT_NOFILE, (p.num_fds(), old[1]))
            return f"pid {pid} (at {p.num_fds()} descriptors)", (pid, old)
        except (psutil.Error, ValueError, TypeError) as e:
            return f"pid {pid}: {e}", None

    def _undo_fds_exhausted(self, state) -> None:
        if state is not None:
            with contextlib.suppress(psutil.Error, ValueError):
                psutil.Process(state[0]).rlimit(psutil.RLIMIT_NOFILE, state[1])

    def _garbage(self):
        seed = self.rng.randrange(1 << 30)
        said = []
        here = subprocess.run([sys.executable, "-c", GARBAGE, str(seed), ",".join(map(str, self.local_pids()))],
                              capture_output=True, text=True, timeout=120)
        said.append(f"here: {here.stdout.strip() or here.stderr[-200:]}")
        for host in self.net.hosts:
            ns = self.net.netns(host)
            r = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", GARBAGE, str(seed), ""],
                               capture_output=True, text=True, timeout=120)
            said.append(f"{host}: {r.stdout.strip() or r.stderr[-200:]}")
        return "ports, connections: " + "; ".join(said), None


def hold(seconds: float, stop) -> None:
    """Wait ``seconds`` (or until ``stop`` is set)."""
    stop.wait(seconds)


def undo_all(faults: Faults, active: list) -> None:
    """Undo what is still in force (at the end, or after an error)."""
    for kind, state in active:
        try:
            faults.undo(kind, state)
        except Exception as e:  # the run must still end everything
            log(f"chaos: undoing {kind} failed: {e!r}")
    active.clear()
    time.sleep(0)
