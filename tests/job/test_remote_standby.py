"""Warm replacements on other hosts (issue 44 point 2): each host's agent keeps a standby
template holding the heavy modules its ranks imported (read from their ``/proc``), and a rank
its mesh's restart policy replaces there forks from it: the replacement has torch before its
actor runs.  Real ranks on the network-namespace hosts (``support/cluster.py``); the figures
(SIGKILL to the replacement's first answer, warm and cold) are printed."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import signal
import sys
import time

import psutil
import pytest
from support.actors import wait_until
from support.cluster import checkout_python
from support.waiting import until

from monarch_kernel import Actor, endpoint
from monarch_kernel.job import SSHJob
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(240)


class TorchUser(Actor):
    """Imports torch when first called, as a training cell would; says whether its rank had
    torch before the actor was built (forked warm)."""

    def __init__(self):
        self.warm = "torch" in sys.modules  # before this actor imported anything

    @endpoint
    def total(self) -> float:
        import torch

        return float(torch.ones(4).sum())

    @endpoint
    def started(self) -> tuple:
        return self.warm, os.getpid()


@pytest.fixture
def job(ssh_hosts, tmp_path):
    job = SSHJob(python_exe=checkout_python(str(tmp_path)), ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts)
    yield job
    job.kill()


def _replace(procs, users, after: int) -> tuple[float, bool, int]:
    """SIGKILL rank 1 (on host 1); seconds from then to its replacement's first answer (a
    torch op), whether it had torch before its actor ran, and its pid."""
    one = users.slice(hosts=1)
    _warm, pid = one.started.call_one().get(timeout=60)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    event = procs.wait_restart(after=after, timeout=90)
    assert (event.kind, event.ranks) == ("restart", (1,)), event
    assert one.total.call_one().get(timeout=90) == 4.0
    seconds = time.monotonic() - t0
    warm, new = one.started.call_one().get(timeout=60)
    assert new != pid
    return seconds, warm, new


def _links(procs) -> list:
    """The controller's links to the agents of ``procs``' hosts, in rank order (the newest
    live one of each host: earlier tests' jobs had links to the same hosts)."""
    links = list(Runtime.current().launcher.links.values())
    return [next(lk for lk in reversed(links) if lk.host == h and lk.alive) for h in procs.ref.hosts]


def test_a_rank_replaced_on_another_host_forks_from_its_agents_warm_standby(job, ssh_hosts):
    procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure", max_restarts=-1)
    users = procs.spawn("users", TorchUser)
    assert list(users.total.call().get(timeout=120).values()) == [4.0, 4.0]  # the ranks import torch
    assert [w for w, _pid in users.started.call().get(timeout=60).values()] == [False, False]
    # Cold first: each agent is asked for a standby and answers at once, while it imports torch
    # (over a second); the rank killed meanwhile asks for it, and is forked from the agent's
    # ordinary template instead.
    procs.warm_standby()
    wait_until(lambda: all(link.standby is not None for link in _links(procs)), 60, "both agents to answer a Warm")
    cold, was_warm, _ = _replace(procs, users, 0)
    print(f"\nremote replacement, SIGKILL to first answer: cold {cold:.3f} s (forked warm: {was_warm})")
    wait_until(lambda: "torch" in procs.warm_standby(), 120, "both hosts' standby templates to import torch")
    warm, was_warm, pid = _replace(procs, users, 1)
    assert was_warm, "the replacement imported torch itself: it did not fork from the agent's standby"
    assert pid in ssh_hosts.pids(ssh_hosts.hosts[1])  # on the same host, in its namespace
    print(f"remote replacement, SIGKILL to first answer: warm {warm:.3f} s")
    # The standby is kept: a second death is replaced warm too, and the other rank was never touched.
    _again, was_warm, pid = _replace(procs, users, 2)
    assert was_warm
    assert [w for w, _pid in users.started.call().get(timeout=60).values()] == [False, True]
    # A rank forked by the standby is the standby's to dump and to kill (the agent asks its parent).
    report = procs.stacks(method="py-spy")
    assert [s.method for s in report.stacks] == ["py-spy", "py-spy"], report.summary()
    assert procs.replace_hung([1], timeout=30) == [1]  # SIGKILLed through the agent
    assert procs.wait_restart(after=3, timeout=90).ranks == (1,)
    warm, new = users.slice(hosts=1).started.call_one().get(timeout=60)
    assert warm and new != pid


# What makes host 0's agent one of before ``Warm``: the op is unknown to its decoder, so the
# message is dropped as any unknown one is (``agent_channel.decode``), and never answered.
UNAWARE = "import monarch_kernel.runtime.spawn.host_messages as m\nm.OPS.pop('warm', None)\n"


@pytest.fixture
def mixed_job(ssh_hosts, tmp_path):
    """A job whose host 0 runs an agent that does not know ``Warm``, host 1 this checkout's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    unaware = tmp_path / "unaware"
    unaware.mkdir()
    (unaware / "sitecustomize.py").write_text(UNAWARE)
    python = tmp_path / "python"  # sshd's SSH_CONNECTION names the address the host was reached on
    python.write_text(f'#!/bin/sh\nset -- $SSH_CONNECTION "$@"\nexport PYTHONPATH={root}\n'
                      f'if [ "$3" = {ssh_hosts.hosts[0]} ]; then export PYTHONPATH={unaware}:{root}; fi\nshift 4\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    job = SSHJob(python_exe=str(python), ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts)
    yield job
    job.kill()


def test_an_agent_that_does_not_know_warm_leaves_the_controller_working_and_its_ranks_cold(mixed_job):
    """An older agent drops ``Warm`` (an unknown op) and never answers: the controller never
    waits for it, never sends it a ``Fork`` it cannot read, and its ranks are still replaced,
    cold; the new agent's are warm beside it."""
    procs = mixed_job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure", max_restarts=-1)
    users = procs.spawn("users", TorchUser)
    assert list(users.total.call().get(timeout=120).values()) == [4.0, 4.0]
    old, new = _links(procs)

    def new_one_warm() -> bool:
        t = time.monotonic()
        held = procs.warm_standby()
        assert time.monotonic() - t < 5, "warm_standby waited on an agent"
        assert held == [], held  # what every host holds: the old one holds nothing
        return "torch" in (new.standby or [])

    wait_until(new_one_warm, 120, "the new agent's standby template to import torch")
    assert old.standby is None  # it never answered
    for host, after in ((1, 0), (0, 1)):
        one = users.slice(hosts=host)
        pid = one.started.call_one().get(timeout=60)[1]
        os.kill(pid, signal.SIGKILL)
        event = procs.wait_restart(after=after, timeout=90)
        assert (event.kind, event.ranks) == ("restart", (host,)), event
        assert one.total.call_one().get(timeout=90) == 4.0
        assert one.started.call_one().get(timeout=60)[0] is (host == 1)  # warm from the new agent only


class Importer(Actor):
    @endpoint
    def load(self, name: str) -> bool:
        importlib.import_module(name)
        return True


# A package whose import takes SLOW_S (a standby template holding it is busy that long before it
# reads anything), and a quick one; each maps a compiled module, which makes it one a standby holds.
SLOW_S = 6


def _packages(site) -> None:
    spec = importlib.util.find_spec("_heapq")
    if spec is None or not (spec.origin or "").endswith(".so"):
        pytest.skip("this python has _heapq built in: no compiled module to give the test packages")
    for name, body in (("slowpkg", f"import time\ntime.sleep({SLOW_S})\n"), ("quickpkg", "")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(body + "from . import _heapq\n")
        shutil.copy(spec.origin, site / name / os.path.basename(spec.origin))


def test_a_standby_ended_while_it_imports_never_holds_up_its_agent(ssh_hosts, tmp_path):
    """A standby template replaced by a newer one (its ranks imported more) while it still
    imports its modules reads its end only once the import is done.  Its agent must not wait
    for it: an agent's loop held that long stops its beats, and its controller declares the host
    gone (this killed a training rank in CI).  It is killed after its grace instead, and reaped."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    site = tmp_path / "site-packages"
    _packages(site)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexport PYTHONPATH={site}:{root}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    job = SSHJob(python_exe=str(python), ssh_args=ssh_hosts.ssh_args)
    job.add_mesh("workers", ssh_hosts.hosts)
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 1}, restart="on-failure")
        m = procs.spawn("importer", Importer)
        assert list(m.load.call("slowpkg").get(timeout=120).values()) == [True, True]
        procs.warm_standby()  # each agent starts a standby holding slowpkg: busy for SLOW_S
        links = _links(procs)
        wait_until(lambda: all(link.standby is not None for link in links), 60, "both agents to answer a Warm")
        slow = until("both standbys holding slowpkg", lambda: len(s := {
            p for h in ssh_hosts.hosts for p, cmd in _standbys(ssh_hosts, h) if "quickpkg" not in cmd}) == 2 and s, 5)
        assert list(m.load.call("quickpkg").get(timeout=60).values()) == [True, True]
        procs.warm_standby()  # a newer standby holding both: the first one, still importing, is ended
        t0, worst = time.monotonic(), 0.0
        while time.monotonic() - t0 < 4:
            worst = max(worst, *(time.monotonic() - link.last_heard for link in links))
            time.sleep(0.02)
        assert worst < 1.5, f"an agent was silent {worst:.1f} s while its old standby ended"
        assert all(link.alive for link in links)
        wait_until(lambda: not slow & {p for h in ssh_hosts.hosts for p, _ in _standbys(ssh_hosts, h)}, 30,
                   "the ended standbys to be killed and reaped")
    finally:
        job.kill()


def _standbys(ssh_hosts, host: str) -> list[tuple[int, str]]:
    """The (pid, command line) of each template on ``host`` that holds slowpkg (not reaped yet)."""
    out = []
    for pid in ssh_hosts.pids(host):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(psutil.Process(pid).cmdline())
            if "template.server import serve" in cmd and "slowpkg" in cmd:
                out.append((pid, cmd))
    return out
