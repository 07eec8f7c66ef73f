"""W13's reduce and to_mesh halves, on the ranks' ``Collectives`` (the tensor engine's
reductions and transfers), at 4 and 16 CPU ranks ({"a": 2, "b": n/2}):

- a 64 MiB float32 sum over all ranks through ``Collectives.reduce`` (a new tensor, as
  ``t.reduce`` makes) and ``reduce_`` (in place), against ``torch.distributed.all_reduce``
  (gloo, torch's default group) on the same ranks, in turn within each iteration (each
  first in turn); ms (median over iterations of the slowest rank), and the median of the
  iterations' ratios.  A new tensor costs a 64 MiB copy that an in-place all_reduce does
  not make, so ``reduce`` is also set beside torch's own way to a new tensor,
  ``y = x.clone(); all_reduce(y)``;
- every reduction (Monarch's nine, and both scatters) of 4 MiB over dim ``b``, ms;
- 4 MiB and 64 MiB moved from rank 0 to the first rank of slice a=1 through each path
  (``auto``: the one ``Collectives`` picks; ``direct``: one copy out of the peer's memory;
  ``gloo``: send/recv), each iteration beside an ``RDMABuffer.read_into`` of the same bytes
  between the same two ranks (a warm destination, as W4b); and 4 MiB from every rank of
  a=0 to its peer in a=1 at once; MB/s.
"""

from __future__ import annotations

import statistics
import time

from monarch_kernel import Actor, current_rank, endpoint

from ._util import log

BIG = 64 << 20
SMALL = 4 << 20
REDUCTIONS = ("stack", "sum", "avg", "product", "min", "max", "band", "bor", "bxor")


class CollectivesBench(Actor):
    @endpoint
    def setup(self, rendezvous, dims: dict, ranks: list) -> None:
        import torch.distributed as dist

        from monarch_kernel.tensors.rank.collectives import Collectives
        from monarch_kernel.tensors.rank.groups import Groups

        me = current_rank().rank
        self.colls = {mode: Collectives(dims, ranks, me, rendezvous, transfer=mode)
                      for mode in (None, "direct", "gloo")}
        if not dist.is_initialized():  # the baseline: torch's own default group, over the same store
            dist.init_process_group("gloo", store=dist.PrefixStore("raw", Groups.shared(rendezvous).store),
                                    rank=ranks.index(me), world_size=len(ranks))

    @endpoint
    def all_reduce_vs_raw(self, reps: int) -> dict:
        import torch
        import torch.distributed as dist

        coll = self.colls[None]
        x = torch.ones(BIG // 4)
        coll.reduce_(x, None, "sum")  # warm: groups made, pages touched
        coll.reduce(x, None, "sum")  # ... and a result's buffer (of buffers.py)
        dist.all_reduce(x)
        def clone_all_reduce():
            y = x.clone()
            dist.all_reduce(y)
            return y

        clone_all_reduce()
        run = {"raw": lambda: dist.all_reduce(x), "reduce": lambda: coll.reduce(x, None, "sum"),
               "reduce_": lambda: coll.reduce_(x, None, "sum"), "raw_clone": clone_all_reduce}
        out: dict[str, list] = {name: [] for name in run}
        order = list(run)
        for i in range(reps):
            k = i % len(order)
            for name in order[k:] + order[:k]:  # each first in turn: the load drifts
                dist.barrier()
                t0 = time.perf_counter()
                r = run[name]()
                out[name].append(time.perf_counter() - t0)
                del r
        return out

    @endpoint
    def reductions(self, reps: int) -> dict:
        import torch
        import torch.distributed as dist

        coll = self.colls[None]
        n = coll.dims["b"]
        cases = {}
        for red in REDUCTIONS:
            dtype = torch.int32 if red in ("band", "bor", "bxor") else torch.float32
            cases[red] = (torch.ones(SMALL // 4, dtype=dtype), red, False)
        cases["sum_scatter"] = (torch.ones(n, SMALL // 4 // n), "sum", True)
        cases["stack_scatter"] = (torch.ones(n, SMALL // 4 // n), "stack", True)
        out: dict[str, list] = {}
        for name, (t, red, scatter) in cases.items():
            coll.reduce(t, "b", red, scatter)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                coll.reduce(t, "b", red, scatter)
                times.append(time.perf_counter() - t0)
            out[name] = times
        return out

    @endpoint
    def register(self):
        import torch

        from monarch_kernel import RDMABuffer

        self.t = torch.ones(BIG // 4)
        return RDMABuffer(self.t.view(torch.uint8), name="w13")

    @endpoint
    def transfers(self, pairs: list, nbytes: int, reps: int, buf=None) -> dict:
        """Per iteration: an ``RDMABuffer`` read (on the first destination, when ``buf``),
        then the same bytes through each transfer path, each after a one-byte message from
        source to destination so that both start together; seconds per path, timed on the
        destinations (when the bytes are there); the sources return nothing."""
        import torch

        me = current_rank().rank
        if all(me not in p for p in pairs):
            return {}
        t = torch.ones(nbytes // 4)
        tick = torch.zeros(1, dtype=torch.uint8)
        sending = any(s == me for s, _ in pairs)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        reading = buf is not None and me == pairs[0][1]
        out: dict[str, list] = {k: [] for k in (("rdma",) if reading else ()) + ("auto", "direct", "gloo")}
        paths = ("rdma", "auto", "direct", "gloo") if buf is not None else ("auto", "direct", "gloo")
        for i in range(reps + 2):
            for path in paths:
                if path == "rdma":
                    if reading:
                        t0 = time.perf_counter()
                        buf.read_into(dst).get(timeout=60)
                        if i >= 2:
                            out[path].append(time.perf_counter() - t0)
                    continue
                self.colls["gloo"].transfer(tick if sending else None, pairs, like=tick)
                t0 = time.perf_counter()
                self.colls[None if path == "auto" else path].transfer(t if sending else None, pairs, like=t)
                if i >= 2 and not sending:
                    out[path].append(time.perf_counter() - t0)
        if reading:
            out["rdma_transport"] = buf.transport()
        return {} if sending else out

    @endpoint
    def path(self, peer: int) -> str:
        return self.colls[None].transfer_path(peer)


def _slowest(per_rank: dict, key: str | None = None) -> list[float]:
    """Per iteration, the slowest rank's time."""
    series = [v[key] if key else v for v in per_rank.values()]
    series = [s for s in series if s]
    return [max(col) for col in zip(*series, strict=True)]


def _ratio(a, b) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)


def _ms(samples) -> float:
    return round(statistics.median(samples) * 1e3, 2)


def _mbps(nbytes: int, samples) -> float:
    return round(nbytes / 1e6 / statistics.median(samples), 1)


def run(n: int) -> dict:
    from monarch_kernel import this_host
    from monarch_kernel.tensors.rendezvous_actor import serve_rendezvous

    log(f"W13 collectives: {n} ranks")
    with this_host().spawn_procs(per_host={"a": 2, "b": n // 2}) as procs:
        bench = procs.spawn("w13c", CollectivesBench)
        _server, rendezvous = serve_rendezvous(procs.ref.hosts)  # closes with this process
        bench.setup.call(rendezvous, dict(procs.extent), list(procs.shape.ranks)).get(timeout=300)
        reps = 12 if n <= 4 else 6
        got = bench.all_reduce_vs_raw.call(reps).get(timeout=900)
        raw, ours, inplace, cloned = (_slowest(got, k) for k in ("raw", "reduce", "reduce_", "raw_clone"))
        out: dict = {"reduce_64MiB_sum_ms": _ms(ours), "reduce__64MiB_sum_ms": _ms(inplace),
                     "torch_all_reduce_64MiB_ms": _ms(raw), "torch_clone_all_reduce_64MiB_ms": _ms(cloned),
                     # the median of each iteration's ratio: neighbours in time share the load
                     "reduce_over_all_reduce": _ratio(ours, raw), "reduce__over_all_reduce": _ratio(inplace, raw),
                     "reduce_over_clone_all_reduce": _ratio(ours, cloned)}
        log(f"W13 n={n}: {out}")
        per = bench.reductions.call(5).get(timeout=600)
        names = next(iter(per.values())).keys()
        out["reductions_4MiB_over_b_ms"] = {k: _ms(_slowest({p: v[k] for p, v in per.items()})) for k in names}
        far = n // 2  # the first rank of slice a=1
        buf = bench.slice(a=0, b=0).register.call_one().get(timeout=60)
        for nbytes in (SMALL, BIG):
            mib = f"{nbytes >> 20}MiB"
            got = bench.transfers.call([(0, far)], nbytes, 20 if nbytes == SMALL else 6, buf).get(timeout=600)
            recv = next(v for v in got.values() if v)
            one = {k: _mbps(nbytes, recv[k]) for k in ("auto", "direct", "gloo", "rdma")}
            one["rdma_read"] = one.pop("rdma")
            out[f"to_mesh_{mib}_one_pair_MBps"] = one
            out[f"to_mesh_{mib}_path"] = bench.slice(a=1, b=0).path.call_one(0).get(timeout=30)
            out[f"to_mesh_{mib}_over_rdma_read"] = round(one["auto"] / one["rdma_read"], 3)
            out["rdma_transport"] = recv["rdma_transport"]
        pairs = [(b, far + b) for b in range(far)]
        got = bench.transfers.call(pairs, SMALL, 10).get(timeout=300)
        rows = [v for v in got.values() if v]
        out["to_mesh_4MiB_slice_to_slice_MBps_per_pair"] = _mbps(SMALL, _slowest({i: r["auto"] for i, r in
                                                                                 enumerate(rows)}))
    log(f"W13 n={n}: {out}")
    return out


def w13_collectives() -> dict:
    return {"W13_collectives": {"n4": run(4)}}


def w13_collectives_16() -> dict:
    return {"W13_collectives": {"n16": run(16)}}
