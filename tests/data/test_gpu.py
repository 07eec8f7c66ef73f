"""What a machine with a GPU must show (issue 46), between real rank processes: cuda_ipc
reads after the first need no round trip and still see a drop; a CUDA out-of-memory error
gives its reservation back; two ranks on one GPU reduce CUDA tensors (gloo: NCCL refuses
them).  Each test skips here without a GPU; ``python -m benchmarks gpu`` runs them.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from support.freeze import freeze
from support.gpus import needs_cuda

from monarch_kernel import Actor, ActorError, RDMABuffer, current_rank, endpoint, this_host
from monarch_kernel.spmd import setup_torch_distributed

pytestmark = [pytest.mark.timeout(180), needs_cuda()]

ONE_GPU = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


class GpuRank(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def make(self, n: int) -> RDMABuffer:
        self.kept["t"] = torch.arange(n, dtype=torch.float32, device="cuda")
        return RDMABuffer(self.kept["t"], name="gpu")

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def read_sum(self, buf: RDMABuffer) -> tuple:
        dst = torch.empty(buf.size // 4, dtype=torch.float32, device="cuda")
        buf.read_into(dst).get(timeout=60)
        return buf.transport(), float(dst.double().sum())

    @endpoint
    def try_read(self, buf: RDMABuffer) -> str:
        try:
            self.read_sum(buf)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - the kind is the answer
            return type(e).__name__
        return "ok"

    @endpoint
    def exhaust(self) -> None:
        """Reserve GPU memory chunk by chunk until CUDA says out of memory."""
        torch.cuda.set_per_process_memory_fraction(0.05)
        chunks = []
        while True:
            chunks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))

    @endpoint
    def reserved(self) -> int:
        return torch.cuda.memory_reserved()

    @endpoint
    def all_reduce(self) -> tuple:
        import torch.distributed as dist

        t = torch.full((1 << 20,), float(current_rank().rank + 1), device="cuda")
        dist.all_reduce(t)
        return dist.get_backend(), float(t[0]), float(t[-1])


def test_cuda_ipc_reads_after_the_first_need_no_round_trip_and_still_see_a_drop():
    with this_host().spawn_procs(per_host={"gpus": 2}, env=ONE_GPU) as procs:
        owner = procs.slice(gpus=0).spawn("owner", GpuRank)
        reader = procs.slice(gpus=1).spawn("reader", GpuRank)
        n = 1 << 20
        buf = owner.make.call_one(n).get(timeout=60)
        expect = float(n * (n - 1) // 2)
        assert reader.read_sum.call_one(buf).get(timeout=60) == ("cuda_ipc", expect)
        pid = owner.pid.call_one().get(timeout=30)
        freeze(pid)
        try:  # the owner cannot answer: this read asks it nothing
            assert reader.read_sum.call_one(buf).get(timeout=30) == ("cuda_ipc", expect)
        finally:
            os.kill(pid, signal.SIGCONT)
        owner.drop.call_one(buf).get(timeout=30)
        assert reader.try_read.call_one(buf).get(timeout=30) == "BufferDropped"


def test_a_cuda_out_of_memory_error_gives_the_reservation_back():
    with this_host().spawn_procs(per_host={"gpus": 1}, env=ONE_GPU) as procs:
        rank = procs.spawn("rank", GpuRank)
        with pytest.raises(ActorError, match="OutOfMemoryError"):
            rank.exhaust.call_one().get(timeout=120)
        assert rank.reserved.call_one().get(timeout=30) < (64 << 20)


def test_two_ranks_on_one_gpu_reduce_cuda_tensors():
    with this_host().spawn_procs(per_host={"gpus": 2}, env=ONE_GPU) as procs:
        assert setup_torch_distributed(procs) == "gloo"  # the rule: nccl would say "Duplicate GPU detected"
        with pytest.raises(RuntimeError, match=r"needs a GPU of its own per rank, and ranks \[0, 1\] share one"):
            setup_torch_distributed(procs, "nccl")
        rank = procs.spawn("rank", GpuRank)
        got = sorted(rank.all_reduce.call().get(timeout=120).values())
        assert got == [("gloo", 3.0, 3.0)] * 2


class SharedGpuProbe(Actor):
    @endpoint
    def setup(self, rendezvous, dims: dict, ranks: list) -> None:
        from monarch_kernel.tensors.rank.collectives import Collectives

        self.coll = Collectives(dims, ranks, current_rank().rank, rendezvous)

    @endpoint
    def reduce_and_move(self) -> tuple:
        me = current_rank().rank
        t = torch.full((4, 3), float(me + 1), device="cuda")
        total = self.coll.reduce(t, None, "sum")
        moved = self.coll.transfer(t if me == 0 else None, [(0, 1)], like=t)
        return str(total.device), total.cpu().tolist(), None if moved is None else moved.cpu().tolist()


def test_the_tensor_engine_reduces_and_moves_cuda_tensors_of_ranks_on_one_gpu():
    from monarch_kernel.tensors.rendezvous_actor import serve_rendezvous

    with this_host().spawn_procs(per_host={"gpus": 2}, env=ONE_GPU) as procs:
        probes = procs.spawn("probes", SharedGpuProbe)
        server, rendezvous = serve_rendezvous(procs.ref.hosts)
        try:
            probes.setup.call(rendezvous, dict(procs.extent), list(procs.shape.ranks)).get(timeout=60)
            got = probes.reduce_and_move.call().get(timeout=120)
            (dev0, total0, _), (dev1, total1, moved1) = got.values()
            assert dev0.startswith("cuda") and dev1.startswith("cuda")
            assert total0 == total1 == [[3.0] * 3] * 4
            assert moved1 == [[1.0] * 3] * 4
        finally:
            server.close()
