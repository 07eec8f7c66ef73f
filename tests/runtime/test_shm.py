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
        # A call's segments are released on the IO thread once it is answered: after this
        # no-op has run there, every release the calls above queued has run too.
        rt.io.run(lambda: None, timeout=10)
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
        import json, os, sys, time, torch
        from monarch_kernel import Actor, endpoint, this_host
        from monarch_kernel.runtime.process import Runtime

        class Slow(Actor):
            @endpoint
            def hold(self, t, started):
                open(started, "w").close()
                time.sleep(60)

        started = sys.argv[1]
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        slow = procs.spawn("slow", Slow)
        fut = slow.hold.call(torch.ones(1 << 20), started)
        deadline = time.monotonic() + 30
        while not os.path.exists(started):  # the rank holds the argument now
            assert time.monotonic() < deadline, "timed out after 30 s waiting for the rank to start hold()"
            time.sleep(0.05)
        print(json.dumps({"dir": Runtime.current().segments.dir}), flush=True)
        time.sleep(60)
    '''))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "started")], stdout=subprocess.PIPE, text=True)
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
        proc.stdout.close()


def _small_shm_or_skip() -> list[str]:
    """The command prefix that runs a process with its own 8 MiB /dev/shm (a private mount
    namespace), or a skip saying why that is not possible here."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to give a process a small /dev/shm of its own")
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh"]
    probe = subprocess.run(prefix + ["true"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm (needs root or user namespaces): {probe.stderr.strip()}")
    return prefix


def test_a_full_dev_shm_falls_back_to_the_socket_and_leaves_nothing(tmp_path):
    """/dev/shm of 8 MiB: a 16 MiB argument goes through the socket (said once, at the
    caller's line), no half-written segment stays, later arguments use shared memory again
    once there is room, and an RDMABuffer registered meanwhile leaves no torch_* file."""
    script = tmp_path / "full_shm.py"
    script.write_text(textwrap.dedent('''
        import json, os, time, warnings, zlib
        import numpy as np, torch
        from monarch_kernel import Actor, RDMABuffer, endpoint, this_host
        from monarch_kernel.runtime.process import Runtime

        class Holder(Actor):
            @endpoint
            def checksum(self, t) -> float:
                return float(t.double().sum()) if isinstance(t, torch.Tensor) else float(t.astype(np.float64).sum())

            @endpoint
            def register(self, n: int):
                self.t = torch.arange(n, dtype=torch.int32)
                return RDMABuffer(self.t)

            @endpoint
            def read_crc(self, buf) -> int:
                dst = torch.empty(buf.size, dtype=torch.uint8)
                buf.read_into(dst).get(timeout=20)
                return zlib.crc32(dst.numpy())

        def trim() -> None:
            """Give back the warm segments, once the last call has released its own."""
            deadline = time.monotonic() + 5
            while segments() and not rt.segments._pool and time.monotonic() < deadline:
                time.sleep(0.02)
            rt.segments.trim()

        def fill(leave: int) -> None:
            st = os.statvfs("/dev/shm")
            with open("/dev/shm/filler", "ab") as f:
                f.write(b"x" * max(0, st.f_bavail * st.f_frsize - leave))

        def segments() -> list:
            d = Runtime.current().segments.dir
            return sorted(os.listdir(d)) if os.path.isdir(d) else []

        rt = Runtime.current()
        out = {"sums": [], "expect": []}
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
                h = procs.spawn("h", Holder)
                for arg in (torch.ones(4 << 20), np.ones(2 << 20), torch.ones(4 << 20)):  # 16 MiB
                    out["sums"].append(list(h.checksum.call(arg).get(timeout=20).values()))
                    out["expect"].append(float(arg.sum()))
                out["segments_after_big"] = segments()
                small = torch.ones(3 << 19)  # 6 MiB: fits once the failed ones are gone
                out["sums"].append(list(h.checksum.call(small).get(timeout=20).values()))
                out["expect"].append(float(small.sum()))
                out["segments_after_small"] = len(segments())
                trim()
                fill(leave=512 << 10)  # full again: 1 MiB goes through the socket ...
                one = torch.ones(1 << 18)
                out["sums"].append(list(h.checksum.call(one).get(timeout=20).values()))
                out["segments_when_full"] = len(segments())
                os.unlink("/dev/shm/filler")  # ... and through shared memory once there is room
                out["sums"].append(list(h.checksum.call(one).get(timeout=20).values()))
                out["expect"] += [float(one.sum())] * 2
                out["segments_with_room"] = len(segments())
                trim()
                fill(leave=1 << 20)
                buf = h.slice(gpus=0).register.call_one(2 << 20).get(timeout=20)  # 8 MiB
                out["buffer_shared"] = buf._h.shared
                out["read_crc"] = h.slice(gpus=1).read_crc.call_one(buf).get(timeout=20)
                out["expect_crc"] = zlib.crc32(torch.arange(2 << 20, dtype=torch.int32).numpy())
        os.unlink("/dev/shm/filler")
        out["warnings"] = [(w.category.__name__, w.filename, str(w.message)) for w in said]
        out["left"] = sorted(os.path.relpath(os.path.join(d, f), "/dev/shm")
                             for d, dirs, files in os.walk("/dev/shm") for f in files + dirs)
        out["segment_dir"] = os.path.relpath(rt.segments.dir, "/dev/shm")
        print(json.dumps(out), flush=True)
    '''))
    proc = subprocess.run(_small_shm_or_skip() + [sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sums"] == [[e, e] for e in out["expect"]], proc.stderr[-3000:]
    assert out["segments_after_big"] == [], "a segment that did not fit must be removed at once"
    assert out["segments_after_small"] == 1, "an argument that fits must use shared memory"
    assert out["segments_when_full"] == 0
    assert out["segments_with_room"] == 1, "shared memory must be used again once it has room"
    assert (out["buffer_shared"], out["read_crc"]) == (False, out["expect_crc"])
    assert [w[:2] for w in out["warnings"]] == [["SharedMemoryFull", str(script)]], out["warnings"]
    assert "/dev/shm has no room for a 16.0 MiB argument" in out["warnings"][0][2]
    # Ranks have exited: no torch_* file from the buffer, only the controller's directory
    # of warm segments (removed when it exits).
    assert [p for p in out["left"] if not p.startswith(out["segment_dir"])] == [], out["left"]
