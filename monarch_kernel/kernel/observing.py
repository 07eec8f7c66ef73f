"""What ``%mesh``'s observing subcommands do: ``status`` (a live table), ``stacks``, ``top``,
``collectives`` and ``watchdog``.  ``magics.py`` parses their arguments and calls these with
the session.  Runs in the kernel.
"""

from __future__ import annotations

import time

from IPython.core.display_functions import display
from IPython.core.error import UsageError

from ..observe.metrics import top_table
from . import status
from .history_magic import record_samples, record_stacks
from .mesh_cell import ranks_arg
from .session import MeshSession


def status_command(session: MeshSession, a):
    """The table once: a live widget where widgets render, its text the fallback of the
    same display (a frontend shows one of the two), else the text alone."""
    s = session
    procs, _consoles = s.get()
    host = s.hosts.get(procs.name)
    table = status.as_text(procs.name, status.snapshot(procs, s.last_lines, host), detached=host is not None,
                           full=a.all)
    live = s.live.get(procs.name) if host is None else None
    if live is None or live.full != a.all or live.final:  # else the same widget once more: every view stays live
        try:
            live = None if host is not None else status.LiveStatus(s, full=a.all)
        except ImportError:  # no ipywidgets: the text table is all there is
            live = None
        if live is not None:
            old = s.live.pop(procs.name, None)
            if old is not None:
                old.close(note="not updated: a newer %mesh status is")
            s.live[procs.name] = live
    if live is None:
        print(table)
        return None
    display({**live.widget._repr_mimebundle_(), "text/plain": table}, raw=True)


def stacks_command(session: MeshSession, a):
    procs, _consoles = session.get()
    ranks = ranks_arg(a.ranks, len(procs), "RANKS") if a.ranks is not None else None
    report = procs.stacks(ranks, native=a.native, all_threads=a.all_threads, runtime_frames=a.runtime_frames,
                          method="py-spy" if a.py_spy else "auto")
    report = report.name_frames(session.cells.frame)
    record_stacks(report, "stacks")
    return report


def top_command(session: MeshSession, a):
    if a.interval <= 0 or a.count < 0:
        raise UsageError("%mesh top: --interval is seconds over 0 and --count a number of refreshes; "
                         "type  %mesh top --interval 1")
    procs, _consoles = session.get()
    hosts = {r: str(h or "") for r, h in zip(procs.shape.ranks, procs.ref.hosts, strict=False)}
    handle = None
    n = 0
    try:
        while True:
            record_samples(procs.name, session.metrics.sample(procs), hosts)  # the history's samples view too
            table = top_table(session.metrics, procs, hosts)
            if handle is None:
                handle = display({"text/plain": table}, raw=True, display_id=True)
            else:
                handle.update({"text/plain": table}, raw=True)
            n += 1
            if a.count and n >= a.count:
                return None
            time.sleep(a.interval)
    except KeyboardInterrupt:
        return None  # the stop button ends it


def collectives_command(session: MeshSession, _a):
    from ..spmd.controller.collectives import collectives

    procs, _consoles = session.get()
    report = collectives(procs)
    if report.stacks is not None:
        report.stacks.name_frames(session.cells.frame)
    return report


def watchdog_command(session: MeshSession, a):
    if a.seconds == "off":
        session.watchdog.set(None)
        print("watchdog off")
        return
    try:
        seconds = float(a.seconds)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError(f"%mesh watchdog {a.seconds}: give seconds (a number over 0) or off; "
                         f"type  %mesh watchdog 60")
    if a.then not in ("dump", "abort", "restart"):
        raise UsageError(f"%mesh watchdog --then {a.then}: choose dump, abort or restart; type  "
                         f"%mesh watchdog {a.seconds} --then abort")
    if a.then == "restart":
        procs, _consoles = session.get()
        if procs.name in session.hosts or not procs.restart_policy.on_failure:
            raise UsageError(f"%mesh watchdog --then restart needs a restart policy on mesh {procs.name} "
                             "(replacing the stuck rank by itself); type  %mesh policy --restart on-failure  "
                             f"first, or  %mesh watchdog {a.seconds} --then abort  to raise HangError and keep "
                             "the mesh")
    session.watchdog.set(seconds, a.then)
    if a.then == "abort":
        print(f"watchdog on: a cell whose ranks make no progress for {seconds:g} s raises HangError "
              "(the hung collective torn down, the mesh kept)")
    elif a.then == "restart":
        print(f"watchdog on: ranks that make no progress for {seconds:g} s are killed and replaced "
              "under the mesh's restart policy")
    else:
        print(f"watchdog on: a cell that waits on ranks for {seconds:g} s shows their stacks")
