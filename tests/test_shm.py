"""Large arguments to ranks on the same host travel through shared memory: correct,
private to each rank, and never left behind in /dev/shm."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(60)


class Holder(Actor):
    @endpoint
    def checksum(self, t) -> float:
        return float(t.double().sum()) if isinstance(t, torch.Tensor) else float(t.astype(np.float64).sum())

    @endpoint
    def scribble_and_sum(self, t) -> float:
        t += 1  # in place: must not reach the other ranks or the controller
        return float(t.double().sum())


def test_large_tensor_and_array_arguments_are_private_and_cleaned_up():
    rt = Runtime.current()
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        holders = procs.spawn("holders", Holder)
        t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
        expect = float(t.double().sum())
        assert list(holders.checksum.call(t).get(timeout=30).values()) == [expect, expect]
        arr = np.arange(1 << 20, dtype=np.int64)
        assert list(holders.checksum.call(arr).get(timeout=30).values()) == [float(arr.sum())] * 2
        sums = list(holders.scribble_and_sum.call(t).get(timeout=30).values())
        assert sums == [expect + (1 << 20)] * 2  # each rank saw the original, not the other's +1
        assert float(t.double().sum()) == expect  # the controller's tensor is untouched
        # What is left is only the pool of warm segments that no rank maps any more.
        deadline = time.monotonic() + 5
        while set(os.listdir(rt.segments.dir)) != {os.path.basename(e[1]) for e in rt.segments._pool}:
            assert time.monotonic() < deadline, "segments outlived their call"
            time.sleep(0.05)


class Keeper(Actor):
    def __init__(self):
        self.kept = []

    @endpoint
    def keep(self, t) -> None:
        self.kept.append(t[10:])  # a view keeps the whole mapping alive

    @endpoint
    def sums(self) -> list:
        return [float(k.double().sum()) for k in self.kept]

    @endpoint
    def forget(self) -> None:
        self.kept.clear()


def test_a_segment_is_reused_only_once_no_rank_maps_it():
    rt = Runtime.current()
    rt.segments.trim()  # earlier tests' warm segments
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        keeper = procs.spawn("keeper", Keeper)
        n = 1 << 20
        keeper.keep.call(torch.full((n,), 1.0)).get(timeout=30)
        keeper.keep.call(torch.full((n,), 2.0)).get(timeout=30)  # must not overwrite the first
        assert keeper.sums.call_one().get(timeout=30) == [n - 10.0, 2.0 * (n - 10)]
        time.sleep(0.2)
        assert rt.segments._pool == [], "kept arguments are still mapped: nothing to reuse"
        keeper.forget.call().get(timeout=30)
        holder = procs.spawn("holder", Holder)
        t = torch.arange(n, dtype=torch.float32)
        for _ in range(3):
            assert holder.checksum.call_one(t).get(timeout=30) == float(t.double().sum())
        deadline = time.monotonic() + 5
        while not rt.segments._pool:
            assert time.monotonic() < deadline, "a released segment should be pooled for reuse"
            time.sleep(0.05)
        assert len(os.listdir(rt.segments.dir)) <= 2, "reuse must keep the segment count flat"


def test_segments_are_removed_when_the_controller_is_killed(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent('''
        import json, time, torch
        from monarch_kernel import Actor, endpoint, this_host
        from monarch_kernel.runtime.process import Runtime

        class Slow(Actor):
            @endpoint
            def hold(self, t):
                time.sleep(60)

        procs = this_host().spawn_procs(per_host={"gpus": 1})
        slow = procs.spawn("slow", Slow)
        fut = slow.hold.call(torch.ones(1 << 20))
        time.sleep(0.5)
        print(json.dumps({"dir": Runtime.current().segments.dir}), flush=True)
        time.sleep(60)
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        seg_dir = json.loads(proc.stdout.readline())["dir"]
        assert glob.glob(os.path.join(seg_dir, "*")), "the in-flight argument should be in shared memory"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while os.path.exists(seg_dir):
            assert time.monotonic() < deadline, f"{seg_dir} outlived its controller"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
