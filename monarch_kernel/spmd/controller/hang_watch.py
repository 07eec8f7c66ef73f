"""The hang watchdog: when calls to a mesh make no progress for ``seconds``, every rank's stacks
(py-spy for a rank that cannot answer), the flight recorder's collectives and the ranks the
others wait for are written to a file and summarised (``then="dump"``); with ``then="abort"``
the hung work is also torn down (the process group aborted on every rank, the busy ranks
interrupted) and the thread waiting on the mesh raises ``HangError``.  Off unless started::

    with watchdog(procs, 60, then="abort"):
        trainers.step.call(batch).get()     # HangError if the ranks hang for 60 s

Progress, per mesh while this process waits on its ranks: an answer to a call waited on
since the last look at least (calls that come and go between two looks, a loop calling
another actor on the same ranks, are no progress of the ranks the others wait on), a new
call from the waiting thread, a line a rank wrote (where the kernel counts them), a
collective finished on any rank (the flight recorder), or CPU asked for by a rank those
calls wait on, not waiting inside a collective (a rank computing without a word, however
crowded the machine).  ``then="restart"`` reports
the hang, then SIGKILLs the stuck ranks and has the mesh's restart policy ("on-failure")
replace them: the waiting call ends as a death ends it (``ProcessDied``, or the result of an
``@endpoint(retries=N)`` re-sent to the replacement).

Runs in the controller, on a thread of its own; reaches the waiting thread through the
runtime's wait hook (``hooks.wait``), never by raising into it from outside.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...actor.adverbs import calls_sent
from ...runtime import Runtime, config, proc_stats, rank_label
from .collectives import build_report
from .env import existing_env
from .hang_report import HangReport, stuck_ranks, where_stuck

log = logging.getLogger(__name__)
THEN = ("dump", "abort", "restart")
RESTART_NEEDS_POLICY = ("then='restart' needs a restart policy on the mesh (replacing a rank by itself): "
                        "procs.set_restart_policy('on-failure') first (or spawn_procs(restart='on-failure')); "
                        "or use then='abort' (HangError, the mesh kept) or 'dump'")
CPU_BUSY = 0.10  # a busy rank using this share of a core is computing: progress ...
CPU_WANTED = 0.5  # ... or asking for it this share of the time (running, or waiting to run)
TAKE_S = config.seconds("hang_take")  # how long the tear-down waits for the waiting thread to take its HangError
SILENT_S = config.seconds("hang_silent")  # a poll unanswered this long: the rank is silent
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _activity(now: tuple, before: tuple[int, int, int], dt: float) -> str:
    """How a rank computed over the ``dt`` seconds between two samples, or "" if it did not:
    it used a tenth of a core; or its threads ran or waited to run half the time (computing on a
    crowded machine: little of a core, but always wanting it; an idle rank's one wake-up a
    second, late on a crowded machine, is far from that); or a thread was runnable at both
    samples (starved of the CPU all along, its wait not yet counted: a blocked rank's threads
    wake too briefly to be seen twice)."""
    used = (now[0] - before[0]) / _CLK_TCK / dt
    if used >= CPU_BUSY:
        return f"used {used:.0%} of a core"
    if now[4] >= 0 and before[1] >= 0 and (wanted := (now[4] - before[1]) / 1e9 / dt) >= CPU_WANTED:
        return f"ran or waited to run {wanted:.0%} of the time"
    if min(now[5], before[2]) > 0:
        return "a thread runnable at two samples in a row"
    return ""


def check_then(then: str) -> str:
    if then not in THEN:
        raise ValueError(f"then={then!r}: choose 'dump' (report the hang), 'abort' (report it, tear it down "
                         f"and raise HangError) or 'restart' (kill the stuck ranks and replace them)")
    return then


def check_policy(then: str, procs) -> None:
    """``then="restart"`` needs ``procs`` to replace its ranks by itself (a restart policy)."""
    if then == "restart" and (procs is None or not procs.owned or not procs.restart_policy.on_failure):
        raise ValueError(RESTART_NEEDS_POLICY)


@dataclass
class _Mesh:
    """What the watchdog knows of one mesh between ticks."""

    since: float  # when it last progressed (or went idle)
    token: tuple = ()
    reported: bool = False
    polls: dict = field(default_factory=dict)  # env index -> (Future, sent at) of its pending snapshot
    snaps: dict = field(default_factory=dict)  # env index -> its last flight.snapshot
    cpu: Any = None  # the pending proc_stats sample
    cpu_at: float = 0.0
    ticks: dict = field(default_factory=dict)  # rank -> (CPU ticks, CPU wanted ns, runnable) at the last sample
    inside: set = field(default_factory=set)  # ranks inside a collective they have not finished
    settling: set = field(default_factory=set)  # ranks asked for their stacks, their CPU not progress until idle
    why: str = ""  # what the last progress was
    seen: dict = field(default_factory=dict)  # call id -> the ranks it waited on, at the last tick


def watchdog(procs, seconds: float, then: str = "dump", *,
             on_report: Callable[[HangReport], None] | None = None) -> HangWatch:
    """Watch ``procs`` until ``.stop()`` (or the end of a ``with`` block): calls to its ranks
    that make no progress for ``seconds`` are reported (``then="dump"``: printed, and written
    to a file), or also torn down, the waiting thread raising ``HangError`` (``"abort"``)::

        with watchdog(procs, 60, then="abort"):
            trainers.step.call(batch).get()
    """
    check_policy(check_then(then), procs)
    return HangWatch(seconds, then, meshes=lambda: [procs], on_report=on_report).start()


class HangWatch:
    """Watches ``meshes()`` (ProcMeshes) for calls that make no progress for ``seconds``.

    ``activity(mesh name)``: a count of the lines its ranks wrote, if the caller keeps one;
    ``on_report(report)``: shows a ``HangReport`` (default: prints its summary);
    ``frame_namer``: names a frame in a notebook cell; ``waiter``: the thread that raises
    ``HangError`` (default: the one that starts the watch); ``interruptible(procs)``: the
    actor mesh whose calls abort interrupts (default: every actor on the busy ranks).

    Example (``spmd.watchdog`` builds one and starts it)::

        watch = HangWatch(60, "abort", meshes=lambda: [procs]).start()
        ...
        watch.stop()
    """

    def __init__(self, seconds: float, then: str = "dump", *, meshes: Callable[[], list],
                 activity: Callable[[str], int] | None = None, on_report: Callable[[HangReport], None] | None = None,
                 frame_namer=None, waiter: threading.Thread | None = None,
                 interruptible: Callable[[Any], Any] | None = None):
        if not seconds > 0:
            raise ValueError(f"seconds={seconds!r}: give the seconds without progress that make a hang (over 0)")
        self.seconds = float(seconds)
        self.then = check_then(then)
        self.meshes = meshes
        self.activity = activity
        self.on_report = on_report or (lambda report: print("\n".join(report.lines()), flush=True))
        self.frame_namer = frame_namer
        self.waiter = waiter
        self.interruptible = interruptible
        self.tick = max(0.2, min(1.0, self.seconds / 5))
        self.reports: list[HangReport] = []
        self.rearmed: collections.deque[str] = collections.deque(maxlen=32)  # progress seen after a report
        self._state: dict[str, _Mesh] = {}
        self._error: Exception | None = None
        self._taken = threading.Event()  # the waiter took the HangError
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hook: Any = None
        self._next: Any = None  # the wait hook that was there before ours (the kernel's pdb server)

    # ------------------------------------------------------------ starting and stopping

    def start(self) -> HangWatch:
        rt = Runtime.current()
        self.waiter = self.waiter or threading.current_thread()
        self._next = rt.hooks.wait.current()
        self._hook = rt.hooks.wait.install(self)
        self._thread = threading.Thread(target=self._loop, name="mesh-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self) -> HangWatch:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def rearm(self) -> None:
        """A new cell starts: forget hangs already reported and a HangError nobody took."""
        self._error = None
        now = time.monotonic()
        for st in self._state.values():
            st.reported, st.since = False, now

    # ------------------------------------------------------------ the wait hook (hooks.wait)

    def pending(self) -> bool:
        if self._error is not None and threading.current_thread() is self.waiter:
            return True
        nxt = self._next
        return nxt is not None and nxt.pending()

    def run(self, completion) -> None:
        err = self._error
        if err is not None and threading.current_thread() is self.waiter:
            self._error = None
            self._taken.set()
            raise err
        if self._next is not None:
            self._next.run(completion)

    # ------------------------------------------------------------ watching

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                meshes = list(self.meshes())
            except Exception:  # noqa: BLE001 - the kernel's table mid-change: next tick
                continue
            for procs in meshes:
                try:
                    self._watch(procs)
                except Exception as e:  # noqa: BLE001 - a mesh mid-stop: the others are still watched
                    log.warning("monarch_kernel: the hang watchdog could not watch mesh %s: %s", procs.name, e)

    def _watch(self, procs) -> None:
        rt = Runtime.current()
        now = time.monotonic()
        st = self._state.setdefault(procs.ref.id, _Mesh(now))
        if procs.stopped:
            self._state.pop(procs.ref.id, None)
            return
        env = existing_env(procs)
        polls = getattr(env[1], "actor_id", None) if env else None  # the watchdog's own questions are no call to watch
        calls = [c for c in rt.calls_pending_on(procs.ref.id) if not (c[1] == polls and c[2] == "collectives")]
        if not calls:  # nothing waits on the mesh: nothing to watch (and nothing asked of its ranks)
            st.since, st.reported, st.token, st.seen = now, False, (), {}
            return
        # The calls watched are those waited on since the last tick at least: calls that come and
        # go between ticks (a loop calling another actor on the same ranks) are no progress of theirs.
        before, st.seen = st.seen, {c[0]: c[3] for c in calls}
        standing = [c for c in calls if c[0] in before]
        busy = sorted(set().union(*(c[3] for c in standing or calls)))
        in_collective = st.inside = self._poll(st, env, now)
        lines = self.activity(procs.name) if self.activity is not None else 0
        done = sum(max(int(g.get("last_completed", -1)), 0) for s in st.snaps.values()
                   for g in s.get("groups", {}).values())
        sent = calls_sent(procs.ref.id, self.waiter.ident) if self.waiter is not None and self.waiter.ident else 0
        token = (frozenset((c[0], c[3]) for c in standing), sent, lines, done)
        # An actor hosted here serving (the loss plot drawing for a rank's flush): the ranks
        # wait on this process, which is busy, not stuck.
        moved, serving = token != st.token, False
        if moved:  # an answer, a line, a collective: progress, whatever the CPU says
            st.settling.clear()
            st.why = _what_changed(st.token, token)
        elif serving := rt.actors_serving():
            st.why = "an actor this process hosts is serving a call"
        if moved or serving or self._computing(rt, procs, st, busy, in_collective, now):
            if st.reported:  # after a report: said, for whoever asks why it did not hold
                self.rearmed.append(f"mesh '{procs.name}': {st.why}")
            st.token, st.since, st.reported = token, now, False
            return
        if not st.reported and now - st.since >= self.seconds:
            st.reported = True
            self._fire(procs, st, env, busy, self.seconds)  # (at least that long: the report says T)

    def _poll(self, st: _Mesh, env, now: float) -> set[int]:
        """Ask every rank for its flight-recorder snapshot (one question in flight per rank)
        and take the answers that come within a moment (a waiting thread reads its own
        answers); returns the ranks inside a collective they have not finished."""
        if env is None:
            return set()
        ranks, actors = env
        flat = actors.flatten("rank")
        for i in range(len(ranks)):
            if i not in st.polls:
                st.polls[i] = (flat.slice(rank=i).collectives.call_one(2), now)
        deadline = now + min(0.3, self.tick / 2)
        for i, (fut, _at) in list(st.polls.items()):
            try:
                st.snaps[i] = fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                continue  # stopped, or busy: asked again once it answers
            except Exception:  # noqa: BLE001 - that rank's actor failed (it died): no snapshot
                st.snaps.pop(i, None)
            st.polls.pop(i)
        inside = set()
        for i, s in st.snaps.items():
            if i in st.polls and now - st.polls[i][1] > SILENT_S:
                continue  # an old answer: where it is now is unknown (its CPU then counts as work)
            for g in s.get("groups", {}).values():
                if int(g.get("last_enqueued", -1)) > int(g.get("last_completed", -1)):
                    inside.add(ranks[i])
        return inside

    def _computing(self, rt, procs, st: _Mesh, busy: list[int], in_collective: set[int], now: float) -> bool:
        """Whether a busy rank outside a collective asked for CPU since the last sample: the
        time its threads ran or waited to run (``schedstat``), or a thread runnable at two samples
        in a row, so a rank computing on a crowded machine counts though it gets little or none
        of a core; where that is not kept, the CPU it used."""
        om = rt.owned_mesh(procs.ref.id)
        if om is None:
            return False
        used = False
        if st.cpu is not None and st.cpu.done() and st.cpu.error() is None:
            dt = max(1e-3, now - st.cpu_at)
            got = st.cpu.result()
            for r in busy:
                u, before = got.get(r), st.ticks.get(r)
                if u is not None and before is not None and r not in in_collective:
                    active = _activity(u, before, dt)
                    if r in st.settling:  # still dumping the stacks the report asked for (slow, crowded)
                        if not active:
                            st.settling.discard(r)
                        continue
                    if active and not used:
                        used, st.why = True, f"rank {r} {active}"
            st.ticks = {r: (u[0], u[4], u[5]) for r, u in got.items() if u is not None}
            st.cpu = None
        if st.cpu is None:
            st.cpu, st.cpu_at = proc_stats.sample(rt, om, busy, want=True), now
        return used

    # ------------------------------------------------------------ a hang

    def _fire(self, procs, st: _Mesh, env, busy: list[int], waited: float) -> None:
        stacks = None
        try:
            stacks = procs.stacks(timeout=3.0).name_frames(self.frame_namer)
        except Exception as e:  # noqa: BLE001 - the report goes on without them
            log.warning("monarch_kernel: the hang watchdog could not read the stacks of %s: %s", procs.name, e)
        # The ranks' CPU for dumping their stacks is the watchdog's doing, not progress (counted,
        # it ended the stall, and the same hang was reported again): sample anew from here, and
        # a rank's CPU counts again once a sample shows it idle (a dump on a crowded machine
        # can outlast procs.stacks, which then reads it with py-spy).
        st.cpu, st.ticks, st.settling = None, {}, set(busy)
        coll = None
        if env is not None:
            now = time.monotonic()
            silent = [i for i, (fut, at) in st.polls.items() if not fut.done() and now - at >= SILENT_S]
            coll = build_report(procs.name, {i: s for i, s in st.snaps.items() if i not in silent}, silent,
                                time.time_ns())
            coll.stacks = stacks
        stuck, why = stuck_ranks(busy, stacks, coll)
        report = HangReport(procs.name, waited, busy, stuck, why, stacks, coll,
                            {r: where_stuck(stacks, r, self.frame_namer) for r in stuck})
        running: list[int] = []
        if self.then == "abort":
            quiet = {env[0][i] for i in coll.silent} if env is not None and coll is not None else set()
            if stacks is not None:
                quiet |= {s.rank for s in stacks.stacks if s.method != "in-process"}
            running = [r for r in busy if r not in st.inside and r not in quiet]
            report.actions = _abort_words(procs, env, running)
        victims = stuck or busy
        restart = self.then == "restart" and procs.owned and procs.restart_policy.on_failure
        if restart:
            report.actions = [f"{rank_label(victims, brackets=False).capitalize()} killed, to be replaced under "
                              f"mesh '{procs.name}''s restart policy"]
        elif self.then == "restart":  # the kernel's watchdog watches every mesh: this one has no policy
            report.actions = [f"Nothing restarted: mesh '{procs.name}' has no restart policy "
                              f"(%mesh policy {procs.name} --restart on-failure)"]
        report.write()
        self.reports.append(report)
        try:
            self.on_report(report)
        except Exception as e:  # noqa: BLE001 - the file and the HangError still say it
            log.warning("monarch_kernel: the hang watchdog could not show its report: %s", e)
        if self.then == "abort":
            # HangError first, then the tear-down: the waiting call must not end with what the
            # tear-down makes its ranks raise (KeyboardInterrupt, a broken group) instead.
            self._taken.clear()
            self._error = report.error()
            self._taken.wait(TAKE_S)
            self._abort(procs, env, running)
        elif restart:
            try:
                procs.replace_hung(victims)
            except Exception as e:  # noqa: BLE001 - the report said it; the watch goes on
                log.warning("monarch_kernel: the hang watchdog could not restart %s of %s: %s",
                            rank_label(victims), procs.name, e)

    def _abort(self, procs, env, running: list[int]) -> None:
        """Tear the hung work down, keeping the ranks and their namespaces: the calls of
        ``running`` interrupted (the busy ranks neither inside a collective, which the abort
        ends, nor silent: stopped, or in C code holding the GIL, where an interrupt would land
        late, in a later call), then every rank's process group aborted (its connections
        shut, so a collective blocked on it fails at once here and on every peer)."""
        if running:
            actors = self.interruptible(procs) if self.interruptible is not None else None
            procs.interrupt(actors, ranks=running)  # first: the abort below must not be what it interrupts
        if env is not None:
            env[1].abort.broadcast("the hang watchdog found no progress")  # nobody waits on a stuck rank's answer


def _what_changed(before: tuple, now: tuple) -> str:
    """Which part of a mesh's progress token moved (``HangWatch._watch`` builds it)."""
    if not before:
        return "calls began"
    parts = ("the calls waited on changed", "a new call was sent", "a rank wrote a line",
             "a collective finished")
    return "; ".join(p for p, a, b in zip(parts, before, now, strict=True) if a != b)


def _abort_words(procs, env, running: list[int]) -> list[str]:
    """What ``HangWatch._abort`` does, as the HangError and the report say it."""
    done = []
    if env is not None:
        done.append(f"The process group was aborted on every rank of mesh '{procs.name}': make it again "
                    f"with  setup_torch_distributed(procs)  once every rank answers")
    if running:
        done.append(f"{rank_label(running, brackets=False).capitalize()} interrupted")
    return done
