"""How a rank process ends when its procs stop normally: its actors stop (``__cleanup__``),
then what CPython runs at a normal exit: ``atexit`` handlers, and the ``__del__`` of objects
held by the modules the rank imported (their globals are cleared, newest module first).

A rank is a fork of the template, so it cannot return to an interpreter of its own; this is
that exit, done by hand.  It must never wait without a bound: the controller SIGKILLs the
rank after its stop grace, whatever a finalizer is doing.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import weakref

from .. import config

CLEANUP_BUDGET_S = config.seconds("cleanup_budget")

_at_start: set[str] = set()


def snapshot_modules() -> None:
    """At rank start: the modules the template had; those imported later are the rank's own."""
    _at_start.clear()
    _at_start.update(sys.modules)


def stop_actors(slots, budget_s: float = CLEANUP_BUDGET_S) -> None:
    """Stop every actor on its own worker (``ActorSlot.halt``), all at once, waiting at
    most ``budget_s`` for them: a worker still busy, or a ``__cleanup__`` that hangs, is
    left behind."""
    done = []
    for slot in slots:
        if slot._thread is None:
            continue
        ev = threading.Event()

        def halt(slot=slot, ev=ev):
            try:
                slot.halt(None)
            finally:
                ev.set()

        slot.submit(halt)
        done.append(ev)
    deadline = time.monotonic() + budget_s
    for ev in done:
        ev.wait(max(0.0, deadline - time.monotonic()))


def finalize() -> None:
    """What a normal interpreter exit runs, in CPython's order: atexit handlers; then the
    rank's own modules leave ``sys.modules`` and the garbage they leave is collected (its
    ``__del__`` methods run with their globals intact); modules still alive after that have
    their globals cleared, newest first, and are collected again."""
    atexit._run_exitfuncs()
    # The runtime's own modules stay: its IO thread serves until the process ends.
    names = [n for n in list(sys.modules) if n not in _at_start and n.split(".")[0] != "monarch_kernel"]
    alive = []
    for name in reversed(names):
        mod = sys.modules.pop(name, None)
        try:
            alive.append(weakref.ref(mod))
        except TypeError:
            pass  # not a module object (None, or something weakrefs cannot name)
    mod = None
    gc.collect()
    for ref in alive:
        m = ref()
        d = getattr(m, "__dict__", None)
        if isinstance(d, dict):
            d.clear()
    m = d = None
    gc.collect()


def exit_process(slots) -> None:
    """Kind.STOP (ProcMesh.stop): the actors stop and run ``__cleanup__``, then the process
    exits as an interpreter does; on a thread of its own, so that the IO thread still serves
    the calls cleanups make."""
    def go():
        try:
            stop_actors(list(slots))
            for slot in list(slots):
                slot.stop()
            finalize()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                time.sleep(0.02)  # a STOP passed on to this rank's subtree leaves before we do
            finally:
                os._exit(0)

    threading.Thread(target=go, name="monarch-exit", daemon=True).start()
