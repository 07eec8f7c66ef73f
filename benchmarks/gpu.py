"""``python -m benchmarks gpu`` (``make gpu-check``): what a machine with a GPU must show, in
one command of under five minutes printing one JSON object: the CUDA-only tests, then
cuda_ipc reads of 4 KiB, 64 MiB and 1 GiB beside a device-to-device ``copy_`` in the same
rank, shm reads beside ``copy_`` into a preallocated tensor, a few CUDA tensor ops, and an
``all_reduce`` of CUDA tensors by two ranks sharing one GPU.  Without a GPU it says so, runs
the shm part alone, and exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from ._util import ROOT, log

# The tests that need a GPU (each skips without one, saying so).
CUDA_TESTS = [
    "tests/data/test_gpu.py",
    "tests/data/test_data.py::test_cuda_ipc_between_gpu_ranks",
    "tests/parity/test_rdma_compat.py::test_read_into_larger_gpu_memory_and_a_gpu_action",
    "tests/tensors/test_tensor_collectives.py::test_nccl_on_cuda_tensors",
    "tests/spmd/test_spmd.py::test_nccl_where_every_rank_has_a_gpu",
    "tests/runtime/test_gpus.py",
]
TESTS_TIMEOUT_S = 150
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def no_gpu_reason() -> str | None:
    """Why there are no GPU checks to run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to this process (torch.cuda.is_available() is False)"
    return None


def run_tests(timeout: float = TESTS_TIMEOUT_S) -> dict:
    """The CUDA tests in a pytest of their own: counts, and the ids of those that failed."""
    fd, xml = tempfile.mkstemp(prefix="mk-gpu-tests-", suffix=".xml")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={xml}", *CUDA_TESTS]
        try:
            p = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the CUDA tests took over {timeout:.0f} s"}
        out = {"exit_code": p.returncode, "s": round(time.perf_counter() - t0, 1),
               "passed": 0, "failed": [], "skipped": []}
        if os.path.getsize(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    out["failed"].append(name)
                elif case.find("skipped") is not None:
                    out["skipped"].append(name)
                else:
                    out["passed"] += 1
        return out
    finally:
        os.unlink(xml)


def _pair(env: dict | None = None):
    from monarch_kernel import this_host

    from ._gpu_actors import CopyBench

    procs = this_host().spawn_procs(per_host={"gpus": 2}, env=env or {})
    return procs, procs.slice(gpus=0).spawn("owner", CopyBench), procs.slice(gpus=1).spawn("reader", CopyBench)


def reads(device: str, sizes: list[int], runs: int = 15) -> dict:
    """Reads of each size over the best transport between two ranks, beside ``copy_``."""
    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]} \
        if device == "cuda" else {}
    out = {}
    procs, owner, reader = _pair(env)
    with procs:
        for n in sizes:
            buf = owner.register.call_one(n, device).get(timeout=120)
            out[_size(n)] = reader.read_vs_copy.call_one(buf, device, runs).get(timeout=240)
            owner.release.call_one().get(timeout=60)
    return out


def shared_gpu_reduce(nbytes: int = 64 * MiB, runs: int = 10) -> dict:
    """Two ranks on one GPU: the backend ``setup_torch_distributed`` picks, an all_reduce."""
    from monarch_kernel import this_host
    from monarch_kernel.spmd import setup_torch_distributed

    from ._gpu_actors import CopyBench

    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    with this_host().spawn_procs(per_host={"gpus": 2}, env=env) as procs:
        backend = setup_torch_distributed(procs)
        got = procs.spawn("ranks", CopyBench).all_reduce.call(nbytes, runs).get(timeout=120)
        return {"backend": backend, "bytes": nbytes, "ms": [v["ms"] for v in got.values()]}


def tensor_ops() -> dict:
    from monarch_kernel import this_host

    from ._gpu_actors import CopyBench

    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        return procs.spawn("ops", CopyBench).tensor_ops.call_one().get(timeout=120)


def _size(n: int) -> str:
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _host_has(nbytes: int) -> bool:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > nbytes
    except (ValueError, OSError):
        return False


def gpu(tests: bool = True) -> dict:
    """Everything above that this machine can run; ``gpu: false`` and why, without a GPU."""
    t0 = time.perf_counter()
    why = no_gpu_reason()
    out: dict = {"gpu": why is None}
    if why is not None:
        out["no_gpu"] = f"no GPU here ({why}): the CUDA tests and GPU benchmarks need one; the shm part ran alone"
        log(out["no_gpu"])
    else:
        import torch

        out["device"] = torch.cuda.get_device_name(0)
        out["devices"] = torch.cuda.device_count()
        if tests:
            out["cuda_tests"] = run_tests()
        out["cuda_ipc"] = reads("cuda", [4 * KiB, 64 * MiB, GiB])
        out["tensor_ops"] = tensor_ops()
        out["shared_gpu_reduce"] = shared_gpu_reduce()
    sizes = [64 * MiB] + ([GiB] if _host_has(6 * GiB) else [])
    out["shm"] = reads("cpu", sizes)
    out["cpus"] = os.cpu_count()
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out
