"""What the kernel shows of the restarts a mesh's restart policy makes: one line in the
running cell, a line in the Mesh panel's log, an event in the run's history
(``kind="restart"``, or ``"restart-gave-up"`` for a crash loop), and ``%mesh policy``'s text.
It listens to the healer (``actor/self_healing.on_event``); it restarts nothing itself.
"""

from __future__ import annotations

import sys
import threading

from .. import history
from ..actor import self_healing


class RestartNotices:
    """Installed by the session for its lifetime."""

    def __init__(self, session):
        self.session = session
        self._listening = self_healing.on_event(self._event)

    def close(self) -> None:
        self._listening.remove()

    def _event(self, event) -> None:  # on the healer's thread
        if event.mesh not in self.session.meshes:
            return  # another mesh of this process (spawned in code, not by %mesh): procs.events() has it
        line = event.line()
        kind = "restart" if event.kind == "restart" else "restart-gave-up"
        for i, r in enumerate(event.ranks):  # where each is now: a rank whose host was gone moved
            history.record_event(event.mesh, kind, rank=r, detail=line,
                                 host=event.hosts[i] if i < len(event.hosts) else None)
        self.session.panel.event(event.mesh, event.ranks[0], line)
        self.session.run_in_cell(lambda: print(line, file=sys.stdout if event.kind == "restart" else sys.stderr,
                                               flush=True))
        if event.kind == "restart":  # the replacement's fresh console reports its pdb stops here too (on a
            # thread: the survivors' consoles take it after the cell they run, and the healer goes on)
            threading.Thread(target=self.session.pdb.tell_ranks, args=(event.mesh,), daemon=True,
                             name="restart-pdb-setup").start()


def policy_text(procs) -> str:
    """``%mesh policy``: the mesh's restart policy, and every restart it made."""
    p = procs.restart_policy
    if not p.on_failure:
        head = f"mesh {procs.name}: restart never (a dead rank stays dead; %mesh policy --restart on-failure)"
    else:
        limit = "no limit" if p.max_restarts < 0 else f"at most {p.max_restarts} restarts"
        now = len(procs.restart_budget.in_window())
        head = (f"mesh {procs.name}: restart on-failure, {limit} within {p.restart_window:g} s "
                f"({now} in the window now)")
    lines = [head] + [f"  {e.when()} {e.line()}" for e in procs.events()]
    return "\n".join(lines)
