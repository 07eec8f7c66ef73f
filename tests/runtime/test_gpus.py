"""The one rule for which collective backend ranks get (issue 46): nccl only when every rank
has a GPU of its own, gloo when any has none or two share one (NCCL refuses that: "Duplicate
GPU detected"), tested with explicit devices and counts so it holds on any machine; and a
CUDA out-of-memory error letting go of what the failed code held."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from monarch_kernel.runtime import gpus

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("ranks", "devices", "backend"), [
    ([4], [0], "gloo"),      # no GPU
    ([4], [1], "gloo"),      # a one-GPU workstation: four ranks share it
    ([2], [1], "gloo"),
    ([4], [2], "gloo"),      # two per GPU
    ([4], [4], "nccl"),      # one each
    ([2], [8], "nccl"),
    ([2, 2], [2, 1], "gloo"),  # one host of two shares
    ([2, 2], [2, 2], "nccl"),
    ([], [], "gloo"),
])
def test_the_backend_from_ranks_and_devices_per_host(ranks, devices, backend):
    assert gpus.backend_for_counts(ranks, devices) == backend


def test_the_backend_from_each_ranks_device():
    assert gpus.backend_for(["h/GPU-a", "h/GPU-b"]) == "nccl"
    assert gpus.backend_for(["h/GPU-a", "h/GPU-a"]) == "gloo"
    assert gpus.backend_for(["h/GPU-a", None]) == "gloo"
    assert gpus.backend_for(["h1/GPU-a", "h2/GPU-a"]) == "nccl"  # two hosts: two devices
    assert gpus.shared(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4]]


def test_nccl_where_it_cannot_work_says_what_to_pass():
    assert gpus.nccl_refused(["h/a", "h/b"]) is None
    assert gpus.nccl_refused([None, None]) == (
        "backend='nccl' needs a GPU on every rank, and ranks [0, 1] have none (torch.cuda.is_available() is "
        "False there); use backend='gloo', or None to pick nccl only where every rank has one")
    assert gpus.nccl_refused(["h/a", "h/a", "h/b"]) == (
        "backend='nccl' needs a GPU of its own per rank, and ranks [0, 1] share one (NCCL refuses that: "
        "'Duplicate GPU detected'); use backend='gloo' (it reduces CUDA tensors too), or None to pick it, or "
        "spawn at most as many ranks per host as it has GPUs")


def test_a_rank_without_a_gpu_has_no_device():
    if torch.cuda.is_available():
        assert gpus.device_of(0) == gpus.identity(0)
    else:
        assert gpus.device_of(0) is None


class _Held:
    pass


def _fails_holding(kind: type[BaseException], ref: list) -> None:
    held = _Held()
    ref.append(weakref.ref(held))
    raise kind("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_an_out_of_memory_error_lets_go_of_what_the_failed_code_held():
    ref: list = []
    try:
        _fails_holding(torch.OutOfMemoryError, ref)
    except torch.OutOfMemoryError as e:
        kept = e
    gc.collect()
    assert ref[0]() is not None  # the traceback's frame holds it
    assert gpus.release_after_oom(kept)
    gc.collect()
    assert ref[0]() is None


def test_other_errors_are_left_as_they_are():
    ref: list = []
    try:
        _fails_holding(ValueError, ref)
    except ValueError as e:
        kept = e
    assert not gpus.release_after_oom(kept)
    gc.collect()
    assert ref[0]() is not None
    wrapped = RuntimeError("while training")
    try:
        try:
            _fails_holding(torch.OutOfMemoryError, ref)
        except torch.OutOfMemoryError as inner:
            raise wrapped from inner
    except RuntimeError:
        pass
    assert gpus.release_after_oom(wrapped)  # found through the chain
