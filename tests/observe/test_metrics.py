"""Rank metrics: GPU use from ``nvidia-smi``'s answers (parsed here from its documented CSV
form), and a real GPU where there is one."""

from __future__ import annotations

import shutil

import pytest

from monarch_kernel.runtime.spawn import proc_stats

pytestmark = pytest.mark.timeout(60)

APPS = "4321, GPU-aaa, 2048\n4322, GPU-bbb, 512\n999, GPU-aaa, 100\n4321, GPU-aaa, 16\n"
GPUS = "GPU-aaa, 87\nGPU-bbb, 3\n"


def test_nvidia_smis_answers_become_each_ranks_gpu_use():
    assert proc_stats.parse_gpu_usage(APPS, GPUS, {4321, 4322, 5}) == {4321: (87, 2064), 4322: (3, 512)}
    assert proc_stats.parse_gpu_usage("", GPUS, {4321}) == {}
    assert proc_stats.parse_gpu_usage("garbage\n,,\n", "x, y\n", {4321}) == {}


def test_a_process_off_the_gpu_reads_as_none():
    assert proc_stats.measure([999_999_999]) == [(999_999_999, -1, -1, -1, -1, -1, -1)]


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no NVIDIA GPU on this machine (no nvidia-smi)")
def test_a_rank_on_a_gpu_shows_its_use():
    from monarch_kernel import Actor, endpoint, this_host
    from monarch_kernel.observe.metrics import RankMetrics

    class OnGpu(Actor):
        @endpoint
        def hold(self) -> int:
            import torch

            self.t = torch.ones(64 << 20, device="cuda")
            return int(self.t.numel())

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        procs.spawn("g", OnGpu).hold.call_one().get(timeout=60)
        point = RankMetrics().sample(procs)[0]
        assert point.gpu is not None and point.gpu_mib and point.gpu_mib >= 256, point
    finally:
        procs.stop().get(timeout=30)
