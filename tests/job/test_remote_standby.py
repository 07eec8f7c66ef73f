"""Warm replacements on other hosts (issue 44 point 2): each host's agent keeps a standby
template holding the heavy modules its ranks imported (read from their ``/proc``), and a rank
its mesh's restart policy replaces there forks from it: the replacement has torch before its
actor runs.  Real ranks on the network-namespace hosts (``support/cluster.py``); the figures
(SIGKILL to the replacement's first answer, warm and cold) are printed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from support.actors import wait_until
from support.cluster import checkout_python

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

