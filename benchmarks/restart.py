"""W10 (restart): a rank of a 2-rank mesh whose restart policy is "on-failure" is SIGKILLed
after its ranks imported torch; from the SIGKILL to the replacement answering its first call
(a torch op), with the standby template warm (issue 44 point 2's target: under 1 s), and once
cold (killed before the standby imported torch).  Beside
the same run's W2 floor (a raw pyzmq round trip) and a cold ``import torch`` in a fresh
interpreter (what a cold replacement pays on top)."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

from ._util import log
from .floors import pyzmq_rtt

KILLS = 5


def w10_restart() -> dict:
    from monarch_kernel import this_host

    from ._actors import TorchUser

    floor = pyzmq_rtt()[0]
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    cold_import = time.monotonic() - t
    procs = this_host().spawn_procs({"r": 2}, restart="on-failure", max_restarts=-1)
    try:
        users = procs.spawn("users", TorchUser)
        users.total.call().get(timeout=120)  # the ranks import torch
        # Cold first: killed before the healer's next look (restart_warm_every) finds torch,
        # the replacement forks from the template without it and imports it itself.
        t0 = time.monotonic()
        os.kill(procs.rank_states()[1]["pid"], signal.SIGKILL)
        procs.wait_restart(after=0, timeout=60)
        users.slice(r=1).total.call_one().get(timeout=60)
        cold = time.monotonic() - t0
        log(f"W10restart: cold: answered {cold:.3f} s after the SIGKILL")
        deadline = time.monotonic() + 120
        while "torch" not in procs.warm_standby():
            if time.monotonic() > deadline:
                raise TimeoutError("the standby template did not import torch within 120 s")
            time.sleep(0.2)
        one = users.slice(r=1)
        answered, events = [], []
        for k in range(KILLS):
            pid = procs.rank_states()[1]["pid"]
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            event = procs.wait_restart(after=k + 1, timeout=60)
            one.total.call_one().get(timeout=60)
            answered.append(time.monotonic() - t0)
            events.append(event.seconds)
            log(f"W10restart: kill {k + 1}: answered {answered[-1]:.3f} s after the SIGKILL "
                f"(the event says {event.seconds:.3f} s)")
    finally:
        procs.stop().get(timeout=30)
    return {"W10restart_death_to_answer_s": {"median": round(statistics.median(answered), 3),
                                             "max": round(max(answered), 3)},
            "W10restart_event_s": {"median": round(statistics.median(events), 3)},
            "W10restart_cold_death_to_answer_s": round(cold, 3),
            "W10restart_cold_import_torch_s": round(cold_import, 3),
            "W10restart_floor_pyzmq_rtt_us": floor}
