"""``%mesh watchdog SECONDS``: when a cell has waited on ranks that long, their grouped
stacks are shown once in the cell's output, and the Mesh panel marks the ranks whose
stacks differ from the majority (they are the ones to look at).  Off by default.

A timer per cell, on a thread of its own: the cell's thread is blocked in the wait it is
watching.  It looks only at meshes with calls still pending from this kernel, so a cell
that computes locally for a long time is left alone.
"""

from __future__ import annotations

import logging
import threading

from IPython.display import display

from .. import history
from ..runtime import Runtime
from ..spmd.controller.collectives import collectives
from ..spmd.controller.env import has_record
from .history_magic import record_stacks

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, session):
        self.session = session
        self.seconds: float | None = None  # None: off
        self.odd: dict[str, set[int]] = {}  # mesh -> ranks whose stacks differ, while the cell runs
        self._timer: threading.Timer | None = None
        self._cell = 0  # which cell the timer watches (a late timer of an ended cell does nothing)

    def set(self, seconds: float | None) -> None:
        self.seconds = seconds if seconds else None

    def cell_starts(self, *_a) -> None:
        self._cancel()
        self._cell += 1
        self.odd.clear()
        if self.seconds:
            self._timer = threading.Timer(self.seconds, self._fire, (self._cell,))
            self._timer.daemon = True
            self._timer.name = "mesh-watchdog"
            self._timer.start()

    def cell_ends(self, *_a) -> None:
        self._cancel()
        self._cell += 1
        if self.odd:
            self.odd.clear()
            self.session.panel.changed()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, cell: int) -> None:
        rt = Runtime.current()
        for name, (procs, _consoles) in list(self.session.meshes.items()):
            if cell != self._cell:
                return  # the cell ended meanwhile
            if not rt.busy_ranks(procs.ref.id):
                continue
            try:
                report = procs.stacks().name_frames(self.session.cells.frame)
            except Exception as e:  # noqa: BLE001 - a mesh mid-stop: nothing to show
                log.warning("monarch_kernel: the watchdog could not read the stacks of %s: %s", name, e)
                continue
            if cell != self._cell:
                return
            self.odd[name] = set(report.odd_ranks())
            secs = f"{self.seconds:g}"
            flight = _collectives(procs)
            history.record_event(name, "watchdog", detail="\n".join(
                [f"the cell waited on {name} for {secs} s; ranks whose stacks differ: {report.odd_ranks() or 'none'}",
                 *flight]))  # and the flight recorder's findings: who holds a collective up
            record_stacks(report, "watchdog")

            def show(report=report, name=name, secs=secs, flight=flight) -> None:
                print(f"%mesh watchdog: the cell has waited on {name} for {secs} s; its ranks are here:")
                if flight:
                    print("\n".join(flight))
                display(report)

            self.session.run_in_cell(show)
            self.session.panel.changed()


def _collectives(procs) -> list[str]:
    """The flight recorder's lines when some ranks wait inside a collective (else none)."""
    if not has_record(procs):
        return []
    try:
        report = collectives(procs, stacks=False)
    except Exception as e:  # noqa: BLE001 - the stacks still show
        log.warning("monarch_kernel: the watchdog could not read the collectives of %s: %s", procs.name, e)
        return []
    return [f"  {line}" for line in report.lines()] if report.holding_up() else []
