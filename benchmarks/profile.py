"""Where W2's time goes: ``python -m benchmarks.profile [SECONDS]``.

Prints the CPU time per round trip of both processes (ZeroMQ's I/O threads included) for
W2's ``call_one`` and, in the same run, for the raw pyzmq floor: under load, wall times
mislead and CPU does not.  With SECONDS, it then prints the controller's and the rank's pids
and keeps calling for that long, for a sampling profiler::

    python -m benchmarks.profile 15 &   # then: py-spy record -p PID -r 500 -f raw -o out.txt
"""

from __future__ import annotations

import statistics
import sys
import time

CALLS = 3000


def _cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def floor_cpu_us() -> tuple[float, float, float]:
    """(caller CPU, peer CPU, median wall) per raw DEALER/ROUTER round trip, in µs."""
    import psutil

    from .floors import echo_peer

    with echo_peer() as (p, s):
        for _ in range(200):
            s.send(b"x" * 16)
            s.recv()
        me, peer = psutil.Process(), psutil.Process(p.pid)
        a, b, walls = _cpu(me), _cpu(peer), []
        for _ in range(CALLS):
            t = time.perf_counter()
            s.send(b"x" * 16)
            s.recv()
            walls.append(time.perf_counter() - t)
        return (_cpu(me) - a) / CALLS * 1e6, (_cpu(peer) - b) / CALLS * 1e6, statistics.median(walls) * 1e6


def w2_cpu_us(mesh, rank) -> tuple[float, float, float]:
    """(caller CPU, rank CPU, median wall) per ``call_one`` round trip, in µs."""
    import psutil

    me = psutil.Process()
    a, b, walls = _cpu(me), _cpu(rank), []
    for i in range(CALLS):
        t = time.perf_counter()
        mesh.echo.call_one(i).get()
        walls.append(time.perf_counter() - t)
    return (_cpu(me) - a) / CALLS * 1e6, (_cpu(rank) - b) / CALLS * 1e6, statistics.median(walls) * 1e6


def main(argv: list[str]) -> int:
    import os

    import psutil

    from monarch_kernel import this_host

    from ._actors import Bench

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        mesh = procs.spawn("bench", Bench)
        rank = psutil.Process(mesh.pid.call_one().get(timeout=60))
        for i in range(300):
            mesh.echo.call_one(i).get()
        f, w = floor_cpu_us(), w2_cpu_us(mesh, rank)
        print(f"floor: caller {f[0]:.1f} µs CPU, peer {f[1]:.1f}, median {f[2]:.1f} µs")
        print(f"W2:    caller {w[0]:.1f} µs CPU, rank {w[1]:.1f}, median {w[2]:.1f} µs "
              f"(CPU {(w[0] + w[1]) / (f[0] + f[1]):.2f}x the floor's)", flush=True)
        if argv:
            print(f"controller pid {os.getpid()}, rank pid {rank.pid}: calling for {argv[0]} s", flush=True)
            end = time.monotonic() + float(argv[0])
            while time.monotonic() < end:
                mesh.echo.call_one(1).get()
    finally:
        procs.stop().get(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
