"""A rank killed by the out-of-memory killer is named so: ``ProcessDied: rank 1 was killed by
the out-of-memory killer (it held 211 MiB; the limit was 200 MiB)``, from the kernel log or
the memory cgroup's counters, within a second of the death.  The host case runs one rank
under a memory cgroup of its own (made and removed here), never by exhausting the machine;
the CUDA case formats ``torch.cuda.memory_summary()``'s headline (no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest
from support.actors import Hog

from monarch_kernel import ProcessDied, this_host
from monarch_kernel.runtime.spawn.oom_killer import KernelLog, OomKill, OomKiller, gib

MEMORY_V1 = "/sys/fs/cgroup/memory"
LIMIT = 200 << 20


def _own_memory_group():
    """A fresh v1 memory cgroup with a 200 MiB limit, or a skip saying why there is none."""
    if not os.path.isfile(os.path.join(MEMORY_V1, "cgroup.procs")):
        pytest.skip(f"no cgroup v1 memory controller mounted at {MEMORY_V1}")
    path = os.path.join(MEMORY_V1, f"monarch-oom-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {MEMORY_V1}: {e.strerror} (needs root, or a delegated group)")
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(LIMIT))
    except OSError as e:
        os.rmdir(path)
        pytest.skip(f"cannot set a memory limit in {path}: {e.strerror}")
    return path


def _remove_group(path: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # its last task is still exiting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.timeout(90)
def test_a_rank_killed_by_a_cgroups_oom_killer_is_named_with_what_it_held_and_the_limit():
    group = _own_memory_group()
    try:
        with this_host().spawn_procs(per_host={"gpus": 2}, name="hungry") as procs:
            hog = procs.spawn("hog", Hog)
            pids = list(hog.pid.call().get(timeout=30).values())
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(pids[1]))  # only rank 1 moves into the limited group
            with pytest.raises(ProcessDied) as info:
                hog.slice(gpus=1).grab.call_one(1024).get(timeout=60)
            raised = time.monotonic()
            err = info.value
            assert (err.rank, err.signal, err.pid) == (1, 9, pids[1])
            m = re.match(r"rank 1 was killed by the out-of-memory killer "
                         r"\(it held ([\d.]+) MiB; the limit was 200 MiB\): "
                         rf"mesh 'hungry', pid {pids[1]} on ", str(err))
            assert m, str(err)
            assert 150 < float(m[1]) < 400, str(err)
            assert err.death.how().startswith("killed by the out-of-memory killer (it held ")
            kill = KernelLog().kill_of(pids[1], 0.0)
            if kill is not None:  # the kernel log is readable here: the death was named within 1 s of the kill
                assert raised - kill["at"] < 1.0, (raised, kill)
            assert hog.slice(gpus=0).grab.call_one(8).get(timeout=30) == 8  # the other rank is unharmed
    finally:
        _remove_group(group)


@pytest.mark.timeout(60)
def test_a_plain_sigkill_is_not_called_an_oom_kill():
    with this_host().spawn_procs(per_host={"gpus": 1}, name="killed") as procs:
        hog = procs.spawn("hog", Hog)
        pid = hog.pid.call_one().get(timeout=30)
        fut = hog.grab.call_one(0)
        fut.get(timeout=30)
        import signal
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ProcessDied) as info:
            hog.pid.call_one().get(timeout=30)
        assert "out-of-memory" not in str(info.value)
        assert "killed by signal 9 (SIGKILL)" in str(info.value)


@pytest.mark.timeout(60)
def test_without_the_kernel_log_the_cgroups_own_counters_name_it():
    """A kernel log this user may not read (``dmesg_restrict``): the group's ``oom_kill``
    count, peak and limit still say what happened."""
    group = _own_memory_group()
    child = None
    try:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); "
                                  "held = [b'x' * (8 << 20) for _ in range(128)]"], stdin=subprocess.PIPE)
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(child.pid))
        killer = OomKiller(KernelLog(os.path.join(group, "no-kernel-log-here")))
        killer.forked(child.pid)
        child.communicate(b"go\n", timeout=30)
        assert child.returncode == -9
        kill = killer.explain(child.pid)
        assert kill is not None and kill.limit == LIMIT and kill.source == f"cgroup v1 /{os.path.basename(group)}"
        assert re.fullmatch(r"it held 2\d\d MiB; the limit was 200 MiB", kill.words()), kill.words()
        assert killer.explain(child.pid) is None  # asked again (no new kill counted): nothing
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        _remove_group(group)


def test_sizes_read_as_people_write_them():
    assert gib(12 << 30) == "12 GiB"
    assert gib(int(11.2 * (1 << 30))) == "11.2 GiB"
    assert gib(200 << 20) == "200 MiB"
    assert OomKill(int(11.2 * (1 << 30)), 12 << 30, "kernel log").words() == "it held 11.2 GiB; the limit was 12 GiB"
    assert (OomKill(3 << 30, None, "kernel log", machine=64 << 30).words()
            == "it held 3 GiB; no memory limit: the host has 64 GiB")


def test_the_kernel_logs_oom_records_are_read(tmp_path):
    records = [
        b"6,100,5000000,-;memory: usage 204800kB, limit 204800kB, failcnt 77\n",
        b"6,101,5000100,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        b"oom_memcg=/monarch-oom-test-1,task_memcg=/monarch-oom-test-1,task=python,pid=4242,uid=0\n",
        b"3,102,5000200,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:900000kB, "
        b"anon-rss:190000kB, file-rss:20000kB, shmem-rss:1000kB, UID:0 pgtables:600kB oom_score_adj:0\n",
    ]
    log = KernelLog(str(tmp_path / "kmsg"))
    for r in records:
        log._parse(r.decode())
    log.unreadable = "a file, not the kernel log"  # kill_of reads no more
    kill = log.kill_of(4242, 4.0)
    assert kill == {"pid": 4242, "at": 5.0002, "held": 211000 * 1024, "memcg": "/monarch-oom-test-1",
                    "limit": 204800 * 1024}
    assert log.kill_of(4242, 6.0) is None  # a kill from before the rank was forked is not its


def test_a_cuda_oom_carries_the_memory_summarys_headline(monkeypatch):
    """torch's own ``memory_summary`` formats the figures (from allocator stats given here:
    no GPU on this machine), and the error that reaches the caller carries its headline."""
    import collections

    import torch
    import torch.cuda.memory as cuda_memory

    from monarch_kernel.actor.errors import ActorError
    from monarch_kernel.runtime import RemoteFailure
    from monarch_kernel.runtime.cuda_oom import headline

    g = 1 << 30
    stats = collections.defaultdict(int)
    stats.update({"allocated_bytes.all.current": int(10.5 * g), "allocated_bytes.all.peak": int(11.2 * g),
                  "reserved_bytes.all.current": int(11.6 * g), "reserved_bytes.all.peak": int(11.6 * g),
                  "num_alloc_retries": 3, "num_ooms": 1, "max_split_size": -1})
    monkeypatch.setattr(cuda_memory, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    expected = ("CUDA memory of device 0: allocated 10752 MiB (peak 11468 MiB), reserved 11878 MiB "
                "(peak 11878 MiB); CUDA OOMs: 1, cudaMalloc retries: 3")
    assert headline(torch.cuda.memory_summary(0)) == expected
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except torch.OutOfMemoryError as e:
        failure = RemoteFailure.capture(3, "trainer", "step", e, frames_to_skip=0)
    err = ActorError(failure)
    assert f"OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n{expected}" in str(err)
    assert expected in failure.traceback
    assert expected in getattr(failure.exception(), "__notes__", [])
    plain = RemoteFailure.capture(3, "trainer", "step", RuntimeError("not memory"), frames_to_skip=0)
    assert "CUDA memory" not in plain.message + plain.traceback


def test_a_cgroup_v2_groups_counters_are_read(tmp_path):
    """cgroup v2's files (``memory.events``, ``memory.peak``, ``memory.max``), as the kernel
    writes them, under a root laid out as v2's (this machine mounts v1's memory controller)."""
    from monarch_kernel.runtime.spawn.oom_killer import counters

    group = tmp_path / "user.slice" / "job-7"
    group.mkdir(parents=True)
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 31\noom 2\noom_kill 1\noom_group_kill 0\n")
    (group / "memory.peak").write_text(f"{int(11.2 * (1 << 30))}\n")
    (group / "memory.max").write_text(f"{12 << 30}\n")
    c = counters(2, "/user.slice/job-7", str(tmp_path))
    assert c == {"oom_kill": 1, "failcnt": None, "peak": int(11.2 * (1 << 30)), "limit": 12 << 30}
    assert OomKill(c["peak"], c["limit"], "cgroup v2").words() == "it held 11.2 GiB; the limit was 12 GiB"
    (group / "memory.max").write_text("max\n")
    assert counters(2, "/user.slice/job-7", str(tmp_path))["limit"] is None
