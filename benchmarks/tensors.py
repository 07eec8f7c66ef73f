"""W13: distributed tensors on CPU ranks.  ``chained``: 2,000 ``x = x + 1`` on a 4x4 tensor
inside ``activate()``, then one ``inspect`` (ops per second, the whole span); ``op_inspect``:
one op plus ``inspect`` (median and p99 of 200); ``inspect``: a fetch alone; beside them, in
turn, the floor a fetch cannot beat: a ``call_one`` round trip to a plain actor on rank 0 of
the same procs; and the ranks' tensor memory (live refs) over 100,000 temporaries.  At 4 and 16 ranks.  Monarch 0.7.0 on
this machine, 4 ranks: 11.1 ms for an op plus inspect, 298 chained ops/s.
"""

from __future__ import annotations

import gc
import time

from ._util import log, summary_us


def _one(n: int) -> dict:
    import torch

    from monarch_kernel import inspect, this_host
    from monarch_kernel.tensors.controller.registry import tensor_client

    from ._actors import Bench

    procs = this_host().spawn_procs(per_host={"gpus": n})
    try:
        with procs.activate():
            x = torch.zeros(4, 4)
            x = x + 1
        inspect(x)  # the ranks have imported torch and made their executors

        def chained() -> float:
            t0 = time.perf_counter()
            with procs.activate():
                y = torch.zeros(4, 4)
                for _ in range(2000):
                    y = y + 1
            assert inspect(y)[0, 0] == 2000
            return 2000 / (time.perf_counter() - t0)

        rates = [chained() for _ in range(5)]

        def op_inspect() -> float:
            t0 = time.perf_counter()
            with procs.activate():
                y = x + 1
            inspect(y)
            return time.perf_counter() - t0

        echo = procs.spawn("echo", Bench).slice(gpus=0)

        def fetch() -> float:
            t0 = time.perf_counter()
            inspect(x)
            return time.perf_counter() - t0

        def round_trip() -> float:
            t0 = time.perf_counter()
            echo.echo.call_one(1).get()
            return time.perf_counter() - t0

        for _ in range(20):
            for warm in (op_inspect, fetch, round_trip):
                warm()
        lat, fetches, trips = [], [], []
        for _ in range(200):  # in turn: the three share the machine's load
            lat.append(op_inspect())
            fetches.append(fetch())
            trips.append(round_trip())

        client = tensor_client(procs)

        def refs() -> int:
            gc.collect()
            return max(v["refs"] for v in client.backend.stats(client.flush()).get(timeout=60).values())

        before = refs()
        with procs.activate():
            y = torch.zeros(4, 4)
            for i in range(100_000):
                y = y + 1
                if i == 50_000:
                    middle = refs()
        assert inspect(y)[0, 0] == 100_000
        after = refs()
        busy = [v["busy_s"] for v in client.backend.stats(client.flush()).get(timeout=60).values()]
        out = {"chained_ops_per_s": {"median": round(sorted(rates)[2]), "best": round(max(rates))},
               "op_inspect_us": summary_us(lat), "inspect_us": summary_us(fetches),
               "call_one_round_trip_us": summary_us(trips),
               "rank_refs_over_100k_temporaries": {"before": before, "midway": middle, "after": after},
               "rank_busy_s_max": round(max(busy), 2)}
    finally:
        procs.stop().get(timeout=60)
    log(f"W13 on {n} ranks: {out}")
    return out


def w13() -> dict:
    import os

    return {"W13_tensors": {f"n{n}": _one(n) for n in (4, 16)}, "W13_load_average": os.getloadavg()[0],
            "W13_monarch_reference_n4": {"op_inspect_ms": 11.1, "chained_ops_per_s": 298}}
