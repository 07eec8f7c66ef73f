"""``procs.stacks()``: every thread's stack of some ranks, grouped (``StackReport``).

Two ways to read a rank, and the report says which each rank's stack came from:
- the rank's own dump, from its IO thread: one message to every rank, about 0.1 s for 64
  ranks, and exact for Python frames, but a rank stopped, or stuck in C code that holds
  the GIL, cannot answer;
- py-spy, run by the rank's template or host agent (its parent), from outside the rank's
  interpreter: it reads any rank, a stopped one too, and C frames with ``native``, but each
  rank costs a py-spy process (about 40 ms of CPU).
``method="auto"`` (the default) asks every rank first and sends py-spy to those that did not
answer within ``stacks_self_wait``; ``"py-spy"`` reads every rank from outside (``native``
implies it); ``"in-process"`` only asks.
"""

from __future__ import annotations

import json
import time

from ..runtime import Runtime, config, stack_dump
from .stack_report import RankStack, StackReport, from_json

METHODS = ("auto", "py-spy", "in-process")


def take(ref, chosen: list[int], *, native: bool = False, all_threads: bool = False, runtime_frames: bool = False,
         method: str = "auto", timeout: float | None = None) -> StackReport:
    """The stacks of ranks ``chosen`` (the mesh's own numbers) of the mesh ``ref`` names."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {', '.join(METHODS)}")
    rt = Runtime.current()
    wait = config.seconds("stacks_wait") if timeout is None else timeout
    deadline = time.monotonic() + wait
    out: dict[int, RankStack] = {}
    why_not: dict[int, str] = {}  # rank -> why py-spy did not read it
    dead = {r: rt.death(ref.id, r) for r in chosen}
    for r, d in dead.items():
        if d is not None:
            out[r] = RankStack(r, ref.hosts[r], "none", error=f"the rank is dead ({d})")
    alive = [r for r in chosen if r not in out]
    if native and method == "in-process":
        raise ValueError("native frames need py-spy: use method='py-spy' (or 'auto')")
    if method == "in-process" or (method == "auto" and not native):
        budget = wait if method == "in-process" else min(wait, config.seconds("stacks_self_wait"))
        _parse_own(out, ref, stack_dump.ask(rt, ref, alive, budget), "in-process")
    rest = [r for r in alive if r not in out]
    om = rt.owned_mesh(ref.id)
    if rest and method != "in-process":
        if om is None:
            why_not.update({r: "this process did not spawn the mesh, so it has no template to run it" for r in rest})
        elif not config.stacks_py_spy():
            why_not.update({r: f"off ({config.env_name('stacks_py_spy')}=0)" for r in rest})
        else:
            _spy(out, why_not, rt, om, ref, rest, native, max(0.5, deadline - time.monotonic()))
    rest = [r for r in alive if r not in out]
    if rest and method == "py-spy":  # py-spy failed on them: they may still answer themselves
        _parse_own(out, ref, stack_dump.ask(rt, ref, rest, max(0.5, deadline - time.monotonic())),
                   "in-process (py-spy: {why})", why_not)
    for r in alive:
        if r not in out:
            tried = f"py-spy: {why_not[r]}; " if r in why_not else ""
            out[r] = RankStack(r, ref.hosts[r], "none", error=(
                f"{tried}the rank did not dump its own stacks within {wait:g} s (a rank stopped, or in C code "
                f"holding the GIL, cannot); pip install py-spy where the ranks run, and call again"))
    return StackReport(ref.name, list(out.values()), all_threads=all_threads, runtime_frames=runtime_frames)


def _spy(out: dict, why_not: dict, rt, om, ref, ranks: list[int], native: bool, wait: float) -> None:
    got = stack_dump.sample(rt, om, ranks, native)
    if not got.wait(wait) or got.error() is not None:
        why_not.update({r: f"py-spy did not answer within {wait:g} s" for r in ranks})
        return
    label = "py-spy --native" if native else "py-spy"
    for r, d in got.result().items():
        if d.status == 0:
            try:
                out[r] = from_json(r, ref.hosts[r], label, json.loads(d.out))
                continue
            except (ValueError, TypeError, AttributeError) as e:
                why_not[r] = f"its output did not parse ({e})"
                continue
        why_not[r] = _reason(d.err.decode(errors="replace").strip().splitlines(), d.status)


def _parse_own(out: dict, ref, dumps: dict[int, bytes], label: str, why_not: dict | None = None) -> None:
    for r, data in dumps.items():
        try:
            out[r] = from_json(r, ref.hosts[r], label.format(why=(why_not or {}).get(r, "")), json.loads(data))
        except (ValueError, TypeError, AttributeError):
            continue  # not a dump we can read: it counts as no answer


def _reason(err: list[str], status: int) -> str:
    """py-spy's own first line of complaint, or its status."""
    for line in err:
        line = line.strip()
        if line and not line.startswith(("Stack backtrace", "0:", "1:")):
            return line[:200]
    return f"py-spy exited with status {status}"
