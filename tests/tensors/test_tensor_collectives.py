"""The ranks' collectives of distributed tensors (monarch_kernel.tensors.rank.collectives) on a
real 2x2 mesh: every one of Monarch's reductions over one dim, the other, and both, checked
against the same reduction computed here; scatter (reduce_scatter and all_to_all), in-place
reductions, a slice's own view, and tensors moved between the mesh's slices, both ways a
pair can move them (straight out of the peer's memory, and over gloo).  One mesh for the
module; a test actor calls ``Collectives`` on each rank."""

from __future__ import annotations

import functools
import operator

import pytest

from monarch_kernel import Actor, ActorError, current_rank, endpoint, this_host
from monarch_kernel.tensors.errors import PeerFailed
from monarch_kernel.tensors.rendezvous_actor import serve_rendezvous

pytestmark = pytest.mark.timeout(120)
torch = pytest.importorskip("torch")

REDUCTIONS = ("stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor")
DIM_SETS = (("b",), ("a",), None)  # None: all dims


def shard(rank: int, dtype) -> torch.Tensor:
    """Rank ``rank``'s input: small values, distinct per rank, exact in every dtype used."""
    base = torch.tensor([[rank + 1, 2 * rank + 3, 7 - rank], [3, rank + 5, 2 * rank + 1]], dtype=torch.int64)
    return base.to(dtype)


class CollectiveProbe(Actor):
    @endpoint
    def setup(self, rendezvous, dims: dict, ranks: list) -> dict:
        from monarch_kernel.tensors.rank.collectives import Collectives

        me = current_rank().rank
        self.coll = Collectives(dims, ranks, me, rendezvous)
        self.forced = {m: Collectives(dims, ranks, me, rendezvous, transfer=m) for m in ("direct", "gloo")}
        return self.coll.point

    @endpoint
    def reduce(self, cases: list) -> list:
        me = current_rank().rank
        return [self.coll.reduce(shard(me, dtype), dims, red, scatter) for dims, red, scatter, dtype in cases]

    @endpoint
    def reduce_scatter_inputs(self, reduction: str, dtype) -> tuple:
        me = current_rank().rank
        x = torch.stack([shard(me, dtype)[0], shard(me + 4, dtype)[0]])  # outer dim of the group's size
        return x, self.coll.reduce(x, "b", reduction, scatter=True)

    @endpoint
    def in_place(self) -> list:
        me = current_rank().rank
        t = shard(me, torch.float32).requires_grad_()  # a parameter's values reduce too
        same = self.coll.reduce_(t, "a", "max") is t
        t = t.detach()
        x = torch.stack([shard(me, torch.int64)[0], shard(me + 4, torch.int64)[0]])
        y = x.t().contiguous().t()  # not contiguous: the result still lands in it
        same_y = self.coll.reduce_(y, "b", "stack", scatter=True) is y
        return [same, t, same_y, y]

    @endpoint
    def on_two_streams(self, rounds: int) -> list:
        """Two threads at once, each on a stream of its own (groups of their own)."""
        import threading

        me = current_rank().rank
        got: dict = {}

        def run(stream: str, dims: str) -> None:
            got[stream] = [self.coll.reduce(shard(me, torch.float32) * i, dims, "sum", stream=stream)
                           for i in range(1, rounds + 1)]

        threads = [threading.Thread(target=run, args=args) for args in (("x", "a"), ("y", "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [got["x"], got["y"]]

    @endpoint
    def view_of_slice(self, dims: dict, ranks: list):
        me = current_rank().rank
        return self.coll.submesh(dims, ranks).reduce(shard(me, torch.float32), None, "sum", stream="side")

    @endpoint
    def transfer(self, pairs: list, nbytes: int, mode: str, failed: int | None = None):
        """``failed``: the rank whose input failed (it sends a stand-in, saying so)."""
        me = current_rank().rank
        t = torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * me
        try:
            got = self.forced[mode].transfer(t if any(s == me for s, _ in pairs) else None, pairs, like=t,
                                             failed=failed if me == failed else None)
        except PeerFailed as e:
            return f"PeerFailed: {e}"
        return None if got is None else (got[:3].tolist(), got[-1].item(), got.shape[0])

    @endpoint
    def paths(self, peer: int) -> list:
        return [self.coll.transfer_path(peer), self.forced["gloo"].transfer_path(peer)]

    @endpoint
    def on_cuda(self) -> list:
        """nccl: a native sum and a gathered band over b (one GPU per b), and a transfer
        between ranks on different GPUs; results back on the CPU."""
        me = current_rank().rank
        torch.cuda.set_device(me % 2)
        dev = torch.device("cuda", me % 2)
        out = [self.coll.reduce(shard(me, dt).to(dev), "b", red).cpu()
               for red, dt in (("sum", torch.float32), ("band", torch.int64))]
        t = shard(me, torch.float32).to(dev)
        got = self.coll.transfer(t if me == 0 else None, [(0, 3)], like=t) if me in (0, 3) else None
        return [*out, None if got is None else got.cpu()]

    @endpoint
    def bad(self, case: str):
        me = current_rank().rank
        if case == "stack over two dims":
            self.coll.reduce(shard(me, torch.float32), ("a", "b"), "stack")
        elif case == "bitwise float":
            self.coll.reduce(shard(me, torch.float32), "a", "bor")
        elif case == "unknown dim":
            self.coll.reduce(shard(me, torch.float32), "gpus", "sum")


@pytest.fixture(scope="module")
def mesh():
    with this_host().spawn_procs(per_host={"a": 2, "b": 2}) as procs:
        probes = procs.spawn("probes", CollectiveProbe)
        server, rendezvous = serve_rendezvous(procs.ref.hosts)  # in this process: no listener is opened
        points = probes.setup.call(rendezvous, dict(procs.extent), list(procs.shape.ranks)).get(timeout=60)
        assert {p["a"] * 2 + p["b"] for p in points.values()} == {0, 1, 2, 3}
        yield probes
        server.close()


def members(rank: int, dims) -> list[int]:
    a, b = divmod(rank, 2)
    dims = ("a", "b") if dims is None else dims
    return [x * 2 + y for x in ((0, 1) if "a" in dims else (a,)) for y in ((0, 1) if "b" in dims else (b,))]


def expected(parts: list, reduction: str):
    if reduction == "stack":
        return torch.stack(parts)
    if reduction == "avg":
        total = functools.reduce(operator.add, parts)
        return total / len(parts) if total.is_floating_point() else torch.div(total, len(parts), rounding_mode="trunc")
    fn = {"sum": operator.add, "product": operator.mul, "min": torch.minimum, "max": torch.maximum,
          "band": operator.and_, "bor": operator.or_, "bxor": operator.xor}[reduction]
    return functools.reduce(fn, parts)


def test_every_reduction_over_one_dim_the_other_and_both(mesh):
    bitwise, other = (torch.int64, torch.int8), (torch.float32, torch.int32)
    cases = [(dims, red, False, dtype) for dims in DIM_SETS for red in REDUCTIONS
             for dtype in (bitwise if red in ("band", "bor", "bxor") else other)
             if not (red == "stack" and dims is None)]
    cases.append((("a", "b"), "sum", False, torch.float64))
    got = mesh.reduce.call(cases).get(timeout=90)
    for point, results in got.items():
        rank = point["a"] * 2 + point["b"]
        for (dims, red, _s, dtype), result in zip(cases, results, strict=True):
            want = expected([shard(m, dtype) for m in members(rank, dims)], red)
            assert result.dtype == dtype and torch.equal(result, want), (rank, dims, red, dtype, result, want)


def test_stack_over_all_dims_is_refused_and_errors_say_what_to_do(mesh):
    with pytest.raises(ActorError, match="takes one dim, not 2"):
        mesh.bad.call("stack over two dims").get(timeout=30)
    with pytest.raises(ActorError, match="bitwise: it needs an integer or bool tensor, not float32"):
        mesh.bad.call("bitwise float").get(timeout=30)
    with pytest.raises(ActorError, match="the mesh has no dim 'gpus'; its dims are a, b"):
        mesh.bad.call("unknown dim").get(timeout=30)


@pytest.mark.parametrize("reduction,dtype", [("sum", torch.float32), ("avg", torch.float32), ("bxor", torch.int64),
                                             ("avg", torch.int64), ("stack", torch.int32)])
def test_scatter_splits_the_outer_dim_across_the_group(mesh, reduction, dtype):
    got = mesh.reduce_scatter_inputs.call(reduction, dtype).get(timeout=60)
    inputs = {p["a"] * 2 + p["b"]: x for p, (x, _r) in got.items()}
    for point, (_x, result) in got.items():
        rank, b = point["a"] * 2 + point["b"], point["b"]
        group = members(rank, ("b",))
        if reduction == "stack":  # all_to_all: row j of the result is member j's row b
            want = torch.stack([inputs[m][b] for m in group])
        else:  # reduce_scatter: this rank's row of the reduction
            want = expected([inputs[m] for m in group], reduction)[b]
        assert torch.equal(result, want), (rank, reduction, result, want)


def test_reduce_in_place_writes_into_the_tensor(mesh):
    got = mesh.in_place.call().get(timeout=60)
    for point, (same, t, same_y, y) in got.items():
        rank = point["a"] * 2 + point["b"]
        assert same and same_y
        assert torch.equal(t, expected([shard(m, torch.float32) for m in members(rank, ("a",))], "max"))
        rows = {m: torch.stack([shard(m, torch.int64)[0], shard(m + 4, torch.int64)[0]]) for m in range(4)}
        assert torch.equal(y, torch.stack([rows[m][point["b"]] for m in members(rank, ("b",))]))


def test_streams_reduce_at_once(mesh):
    got = mesh.on_two_streams.call(3).get(timeout=60)
    for point, (over_a, over_b) in got.items():
        rank = point["a"] * 2 + point["b"]
        for i, (ra, rb) in enumerate(zip(over_a, over_b, strict=True), 1):
            assert torch.equal(ra, expected([shard(m, torch.float32) * i for m in members(rank, ("a",))], "sum"))
            assert torch.equal(rb, expected([shard(m, torch.float32) * i for m in members(rank, ("b",))], "sum"))


def test_a_slice_reduces_over_its_own_ranks(mesh):
    got = mesh.slice(a=1).view_of_slice.call({"b": 2}, [2, 3]).get(timeout=60)
    want = shard(2, torch.float32) + shard(3, torch.float32)
    assert all(torch.equal(v, want) for v in got.values())


@pytest.mark.parametrize("mode", ["direct", "gloo"])
def test_tensors_move_between_slices(mesh, mode):
    n = 4 << 20
    # a=0 -> a=1, rank for rank (a pipeline stage's activations)
    got = {p["a"] * 2 + p["b"]: v for p, v in mesh.transfer.call([(0, 2), (1, 3)], n, mode).get(timeout=60).items()}
    assert got[0] is None and got[1] is None
    for dst, src in ((2, 0), (3, 1)):
        assert got[dst] == ([1000.0 * src, 1000.0 * src + 1, 1000.0 * src + 2], 1000.0 * src + n // 4 - 1, n // 4)
    # both ways at once, and one source to several destinations
    got = {p["a"] * 2 + p["b"]: v for p, v in mesh.transfer.call([(0, 2), (2, 0), (2, 1), (3, 3)], 64, mode)
           .get(timeout=60).items()}
    assert [got[r][0][0] for r in range(4)] == [2000.0, 2000.0, 0.0, 3000.0]
    # a rank that keeps its own tensor and sends it on too
    got = {p["a"] * 2 + p["b"]: v for p, v in mesh.transfer.call([(1, 1), (1, 3)], 64, mode).get(timeout=60).items()}
    assert got[0] is None and got[2] is None and got[1][0][0] == got[3][0][0] == 1000.0


@pytest.mark.parametrize("mode", ["direct", "gloo"])
def test_a_source_whose_input_failed_fails_its_destination_at_once(mesh, mode):
    got = {p["a"] * 2 + p["b"]: v for p, v in mesh.transfer.call([(0, 2), (1, 3)], 4 << 20, mode, 1)
           .get(timeout=60).items()}
    assert got[2][0] == [0.0, 1.0, 2.0], got[2]  # rank 0's input was fine
    assert got[3] == ("PeerFailed: the input of a member of this move (ranks [1, 3]) failed on rank 1; inspect "
                      "that tensor on rank 1 for the op that failed and its traceback"), got[3]
    again = {p["a"] * 2 + p["b"]: v for p, v in mesh.transfer.call([(1, 3)], 64, mode).get(timeout=60).items()}
    assert again[3][0][0] == 1000.0  # the pair's link and group still work


def test_ranks_of_one_host_copy_tensors_directly(mesh):
    assert mesh.slice(a=1, b=0).paths.call_one(0).get(timeout=30) == ["direct", "gloo"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (nccl gives each rank of a group its own GPU); there are none here")
def test_nccl_on_cuda_tensors(mesh):
    got = mesh.on_cuda.call().get(timeout=120)
    for point, (total, band, moved) in got.items():
        rank = point["a"] * 2 + point["b"]
        group = members(rank, ("b",))
        assert torch.equal(total, expected([shard(m, torch.float32) for m in group], "sum"))
        assert torch.equal(band, expected([shard(m, torch.int64) for m in group], "band"))
        assert (moved is None) == (rank != 3) and (rank != 3 or torch.equal(moved, shard(0, torch.float32)))
