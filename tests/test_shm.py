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
        deadline = time.monotonic() + 5
        while os.listdir(rt.segments.dir):
            assert time.monotonic() < deadline, "segments outlived their call"
            time.sleep(0.05)


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
