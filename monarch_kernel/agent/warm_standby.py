"""The host agent's warm standby: a second template holding the heavy modules its ranks
imported (torch, numpy...: ``warm_candidates``, read from a live rank's ``/proc``), which
restarted ranks fork from, so a replacement on this host does not import them again.

It owns its templates and which ranks each forked; what they say of those ranks goes to the
agent's events, as its own template's does.  It never initialises CUDA (the template refuses
a module that does: ``template/fork.py``), and a standby that died importing its modules is
not started again for the same ones.  Every template it started ends with ``close``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..runtime.hosting import TemplateClient, warm_candidates

if TYPE_CHECKING:
    from ..runtime.hosting import LaunchConfig, TemplateEvents

# What a rank of a standby that died reports (its ranks die with it: SIGKILL, their parent-death signal).
KILLED = int(signal.SIGKILL)


class WarmStandby:
    """Construct and call it on the agent's IO thread (a template's parent-death signal is
    tied to the thread that starts it).  ``warm``: what every template of the agent imports;
    ``events``: the agent's, which hear what the standbys' ranks say."""

    def __init__(self, loop, events: TemplateEvents, warm: tuple[str, ...]):
        self.loop, self.events, self.warm = loop, events, warm
        self.current: _Standby | None = None  # the newest standby: restarted ranks fork from it
        self.modules: frozenset[str] = frozenset()  # what it imports (held once it is ready)
        self.older: list[_Standby] = []  # standbys replaced by a newer one, ended once their ranks are
        self.ending: list[TemplateClient] = []  # those told to end, until they have (killed at the agent's exit)

    def held(self) -> list[str]:
        """The modules the standby has imported and forks with: [] while it imports them."""
        t = self.current.template if self.current is not None else None
        return sorted(self.modules) if t is not None and t.alive and t.nofile is not None else []

    def refresh(self, pid: int) -> list[str]:
        """Hold what rank ``pid`` imported too: a new standby is started when it has imported
        heavy modules the standby lacks.  Returns what is held now."""
        new = set(warm_candidates(pid, set(self.warm) | self.modules))
        if new:
            modules = self.modules | new
            standby = _Standby(self, (*self.warm, *sorted(modules)))
            if self.current is not None:
                self.older.append(self.current)
                self.idle(self.current)
            self.current, self.modules = standby, frozenset(modules)
        return self.held()

    def fork(self, launch: LaunchConfig, on_forked: Callable[[int], None], on_failed: Callable[[str], None]) -> bool:
        """Fork a restarted rank from the standby if it is ready (False: it is not)."""
        standby = self.current
        if standby is None or not self.held():
            return False

        def forked(pid: int) -> None:
            standby.ranks.add(pid)
            on_forked(pid)

        standby.template.fork(launch, forked, on_failed)
        return True

    def template_of(self, pid: int) -> TemplateClient | None:
        """The standby that forked rank ``pid`` (None: not one of its ranks)."""
        for standby in self._all():
            if pid in standby.ranks:
                return standby.template
        return None

    def templates(self) -> list[TemplateClient]:
        """The standbys' templates, which fork restarted ranks."""
        return [standby.template for standby in self._all()]

    def close(self) -> None:
        """End every standby, and their ranks with them (the agent is ending); those already
        told to end as well, which may still be importing (they would outlive the agent until
        their import is done: their parent's death is heard only after it)."""
        for template in [*self.ending, *(standby.template for standby in self._all())]:
            template.close()
        self.older, self.current, self.ending = [], None, []

    def _all(self) -> list[_Standby]:
        return [*self.older, *([self.current] if self.current is not None else [])]

    # ------------------------------------------------------------ what a standby says

    def idle(self, standby: _Standby) -> None:
        """An older standby ends once no rank it forked is left."""
        if standby in self.older and not standby.ranks:
            self.older.remove(standby)
            standby.template.end_soon()  # on the IO thread: never wait for it here
            self.ending = [t for t in self.ending if t.proc.poll() is None] + [standby.template]

    def gone(self, standby: _Standby) -> None:
        """A standby itself is gone (killed, or an import failed): its ranks died with it."""
        for pid in sorted(standby.ranks):
            self.events.exited(pid, KILLED)
        standby.ranks.clear()
        if standby in self.older:
            self.older.remove(standby)


class _Standby:
    """One standby template and the live ranks it forked; its ``TemplateEvents``: what its
    ranks say goes to the agent's events, and their exits through the owner."""

    def __init__(self, owner: WarmStandby, modules: tuple[str, ...]):
        self.owner = owner
        self.ranks: set[int] = set()
        self.template = TemplateClient(owner.loop, self, modules)

    def output(self, pid: int, fd: int, data: bytes) -> None:
        self.owner.events.output(pid, fd, data)

    def hello(self, pid: int, hello: bytes) -> None:
        self.owner.events.hello(pid, hello)

    def beats(self, pids: list) -> None:
        self.owner.events.beats(pids)

    def exited(self, pid: int | None, status: int | None) -> None:
        if pid is None:
            self.owner.gone(self)
            return
        self.ranks.discard(pid)
        self.owner.events.exited(pid, status)
        self.owner.idle(self)
