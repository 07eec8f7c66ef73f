"""W1/W6 child: a fresh controller that spawns N ranks and waits for one no-op answer.

Run as a plain script (``python _spawn_child.py N [--rss]``), like a user's script, so its
actor class lives in ``__main__`` and travels by value.  Prints ``READY`` as soon as the
mesh has answered, then one ``RESULT {json}`` line, then stops the mesh.
"""

import time

T0 = time.perf_counter()  # before importing anything else, the runtime above all

import json  # noqa: E402
import sys  # noqa: E402

from monarch_kernel import Actor, endpoint, this_host  # noqa: E402


class Noop(Actor):
    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def pid(self) -> int:
        import os

        return os.getpid()


def main() -> None:
    n = int(sys.argv[1])
    procs = this_host().spawn_procs(per_host={"gpus": n})
    t_procs = time.perf_counter()
    mesh = procs.spawn("noop", Noop)
    mesh.noop.call().get(timeout=60)
    t_answer = time.perf_counter()
    print("READY", flush=True)
    result = {"spawn_s": t_answer - T0, "procs_up_s": t_procs - T0}
    try:
        if "--rss" in sys.argv:
            result.update(_memory(mesh))
    finally:
        print("RESULT " + json.dumps(result), flush=True)
        procs.stop().get(timeout=30)


def _memory(mesh) -> dict:
    import os

    import psutil

    mib = 1 << 20
    me = psutil.Process()
    out = {"controller": me.memory_info().rss / mib}
    pids = list(mesh.pid.call().get(timeout=30).values())
    rank = psutil.Process(pids[0])
    out["rank"] = rank.memory_info().rss / mib
    try:
        full = rank.memory_full_info()
        out["rank_uss"] = full.uss / mib
        out["rank_pss"] = full.pss / mib
    except (psutil.Error, AttributeError) as e:
        out["rank_uss"] = None
        out["rank_uss_error"] = repr(e)
    try:  # the template the ranks are forked from (the ranks' parent, a child of ours)
        tpl = rank.parent()
        if tpl is not None and tpl.ppid() == os.getpid():
            out["template"] = tpl.memory_info().rss / mib
    except psutil.Error:
        pass
    return out


if __name__ == "__main__":
    main()
