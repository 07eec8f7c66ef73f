"""``%mesh watchdog SECONDS [--then dump|abort]``: when the ranks a cell waits on make no
progress for that long, their grouped stacks and the flight recorder's collectives are shown
once in the cell's output and written to a report file, and the Mesh panel marks the ranks
whose stacks differ from the majority; ``--then abort`` also tears the hung work down and the
cell raises ``HangError``.  Off by default.

The watching is ``spmd``'s ``HangWatch`` (on a thread of its own: the cell's thread is blocked
in the wait it watches); here it is given the session's meshes, the lines their ranks print
(progress too), the cells' names for frames, and the cell to show its report in.
"""

from __future__ import annotations

import threading

from IPython.display import display

from .. import history
from ..spmd.controller.hang_watch import HangWatch
from .history_magic import record_stacks


class Watchdog:
    def __init__(self, session):
        self.session = session
        self.seconds: float | None = None  # None: off
        self.then = "dump"
        self.odd: dict[str, set[int]] = {}  # mesh -> ranks whose stacks differ, while the cell runs
        self.watch: HangWatch | None = None
        self._lines: dict[str, int] = {}  # mesh -> lines its ranks printed (progress)
        session.sink.watchers.append(self._line)

    def set(self, seconds: float | None, then: str = "dump") -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        self.seconds = seconds if seconds else None
        self.then = then
        if self.seconds:
            s = self.session
            self.watch = HangWatch(self.seconds, then, meshes=lambda: [p for p, _c in list(s.meshes.values())],
                                   activity=lambda name: self._lines.get(name, 0), on_report=self._show,
                                   frame_namer=s.cells.frame, waiter=threading.current_thread(),
                                   interruptible=self._consoles).start()

    def _consoles(self, procs):
        """The actors the stop button interrupts on ``procs``: its consoles (the cells)."""
        return self.session.meshes.get(procs.name, (None, None))[1]

    def _line(self, mesh: str, _rank: int, _stream: str, _line: str) -> None:
        self._lines[mesh] = self._lines.get(mesh, 0) + 1

    def cell_starts(self, *_a) -> None:
        self.odd.clear()
        if self.watch is not None:
            self.watch.rearm()

    def cell_ends(self, *_a) -> None:
        if self.watch is not None:
            self.watch.rearm()  # a HangError nobody took is not the next cell's
        if self.odd:
            self.odd.clear()
            self.session.panel.changed()

    def _show(self, report) -> None:
        if report.stacks is not None:
            self.odd[report.mesh] = set(report.stacks.odd_ranks())
        secs = f"{self.seconds:g}"
        flight = ([f"  {line}" for line in report.collectives.lines()]
                  if report.collectives is not None and report.collectives.holding_up() else [])
        who = ", ".join(f"rank {r}" for r in report.stuck)
        history.record_event(report.mesh, "watchdog", detail="\n".join(
            [f"the cell waited on {report.mesh} for {secs} s without progress; {who or 'no rank'} held the others "
             f"up ({report.why})", *flight]))  # and the flight recorder's findings: who holds a collective up
        if report.stacks is not None:
            record_stacks(report.stacks, "watchdog")

        def show() -> None:
            print(f"%mesh watchdog: the cell has waited on {report.mesh} for {secs} s without progress; "
                  "its ranks are here:")
            if flight:
                print("\n".join(flight))
            if report.stacks is not None:
                display(report.stacks)
            print(f"%mesh watchdog: {who} {'holds' if len(report.stuck) == 1 else 'hold'} the others up "
                  f"({report.why}); " + (f"full report: {report.path}" if report.path else
                                         f"no report file ({report.path_error})"))
            for action in report.actions:
                print(f"%mesh watchdog: {action}")

        self.session.run_in_cell(show)
        self.session.panel.changed()
