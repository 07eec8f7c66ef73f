"""``procs.stacks()``: every thread's stack of some ranks, grouped (``StackReport``).

py-spy first, run by each rank's template or host agent (the rank's parent), so it sees a
rank stuck in C code, holding the GIL, or stopped.  Where py-spy cannot (not installed,
not allowed, a mesh this process did not spawn), the rank dumps its own threads from its
IO thread; the report says which way each rank's stack was taken.
"""

from __future__ import annotations

import json
import time

from ..runtime import config, stack_dump
from ..runtime.process import Runtime
from .stack_report import RankStack, StackReport, from_json


def take(ref, chosen: list[int], *, native: bool = False, all_threads: bool = False,
         runtime_frames: bool = False, timeout: float | None = None) -> StackReport:
    """The stacks of ranks ``chosen`` (the mesh's own numbers) of the mesh ``ref`` names."""
    rt = Runtime.current()
    wait = config.seconds("stacks_wait") if timeout is None else timeout
    deadline = time.monotonic() + wait
    out: dict[int, RankStack] = {}
    why_not: dict[int, str] = {}
    om = rt.meshes.get(ref.id)
    spy = "py-spy --native" if native else "py-spy"
    if om is not None and not config.stacks_py_spy():
        why_not.update({r: f"off ({config.env_name('stacks_py_spy')}=0)" for r in chosen})
    elif om is not None:
        got = stack_dump.sample(rt, om, chosen, native)
        if got.wait(wait) and got.error() is None:
            for r, d in got.result().items():
                if d.status == 0:
                    try:
                        out[r] = from_json(r, ref.hosts[r], spy, json.loads(d.out))
                        continue
                    except (ValueError, TypeError, AttributeError) as e:
                        why_not[r] = f"py-spy's output did not parse ({e})"
                        continue
                err = d.err.decode(errors="replace").strip().splitlines()
                why_not[r] = _reason(err, d.status)
        else:
            why_not.update({r: f"py-spy did not answer within {wait:g} s" for r in chosen})
    else:
        why_not.update({r: "this process did not spawn the mesh" for r in chosen})
    rest = [r for r in chosen if r not in out]
    if rest:
        dead = {r: rt.death(ref.id, r) for r in rest}
        alive = [r for r in rest if dead[r] is None]
        own = stack_dump.ask(rt, ref, alive, max(0.5, deadline - time.monotonic())) if alive else {}
        for r in rest:
            method = f"in-process (py-spy: {why_not.get(r, 'not tried')})"
            if r in own:
                try:
                    out[r] = from_json(r, ref.hosts[r], method, json.loads(own[r]))
                    continue
                except (ValueError, TypeError, AttributeError) as e:
                    error = f"its own dump did not parse ({e})"
            elif dead[r] is not None:
                error = f"the rank is dead ({dead[r]})"
            else:
                error = (f"{why_not.get(r, 'py-spy was not used')}, and the rank did not dump its own stacks "
                         f"within the {wait:g} s wait (its IO thread may be held by code holding the GIL); "
                         f"pip install py-spy where the ranks run, and call again")
            out[r] = RankStack(r, ref.hosts[r], method, error=error)
    return StackReport(ref.name, list(out.values()), all_threads=all_threads, runtime_frames=runtime_frames)


def _reason(err: list[str], status: int) -> str:
    """py-spy's own first line of complaint, or its status."""
    for line in err:
        line = line.strip()
        if line and not line.startswith(("Stack backtrace", "0:", "1:")):
            return line[:200] if status != -1 else line
    return f"py-spy exited with status {status}"
