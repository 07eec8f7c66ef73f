"""A progress bar on the terminal (stderr) while a command waits on ranks: how many of them
have ended so far, read from ``/proc`` for this machine's ranks.  Piped, or with ``--json``,
nothing is drawn.  It only watches; the work runs as given.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import click

from ..detached import records


def ending(label: str, pids: list[int], work: Callable[[], None], quiet: bool = False) -> None:
    """Run ``work`` (which ends the processes ``pids``), drawing how many have ended."""
    if quiet or not sys.stderr.isatty() or not pids:
        work()
        return
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            failed.append(e)

    worker = threading.Thread(target=run, name="monarch-cli-work", daemon=True)
    worker.start()
    starts = {p: records.start_time(p) for p in pids}
    with click.progressbar(length=len(pids), label=label, file=sys.stderr, show_pos=True) as bar:
        done = 0
        while worker.is_alive():
            worker.join(0.1)
            now = sum(1 for p, s in starts.items() if s is None or records.start_time(p) != s)
            bar.update(now - done)
            done = now
        bar.update(len(pids) - done)  # work returned: every rank has ended (those of other hosts too)
    if failed:
        raise failed[0]
