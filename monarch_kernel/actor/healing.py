"""``Healing``: the restart-policy half of ``ProcMesh`` (mixed into it): the policy, its
budget, the events of the restarts it made, and the watchdog's kill-and-replace.  The work is
the healer's (``self_healing.py``); this is only the surface users call.
"""

from __future__ import annotations

from typing import Any

from ..runtime import RestartPolicy, Runtime
from . import self_healing
from .restart_event import RestartEvent


class Healing:
    """A ``ProcMesh``'s restart policy and its restarts (mixed into ``ProcMesh``, which has
    ``_owned``, ``_ref``, ``name`` and ``kill``).

    Example::

        procs.set_restart_policy("on-failure", max_restarts=3, restart_window=600)
        event = procs.wait_restart(after=0, timeout=60)   # the next RestartEvent
        procs.events()                                    # every one so far
    """

    _owned: Any
    _ref: Any
    name: Any
    kill: Any

    @property
    def restart_policy(self) -> RestartPolicy:
        """What happens when a rank dies: ``RestartPolicy(restart, max_restarts,
        restart_window)``; "never" unless set (``spawn_procs(restart=...)``, ``set_restart_policy``)."""
        return self.restart_budget.policy

    @property
    def restart_budget(self):
        """The policy and the deaths it counted (the runtime's ``RestartBudget``)."""
        if self._owned is None:
            raise RuntimeError(f"mesh '{self.name}' was spawned by another process; its owner holds its restart policy")
        return self._owned.restart_budget

    def set_restart_policy(self, restart: str = "on-failure", *, max_restarts: int = 3,
                           restart_window: float = 600.0) -> RestartPolicy:
        """Replace dead ranks by themselves from now on (``restart="on-failure"``), at most
        ``max_restarts`` within any ``restart_window`` seconds (-1: no limit), after Ray's
        ``max_restarts``; ``"never"`` turns it off.  Each replacement gets the mesh's actors
        again, built with the arguments they were spawned with, and every actor that defines
        ``__on_restart__(event)`` is told.  Returns the policy::

            procs.set_restart_policy("on-failure", max_restarts=3, restart_window=600)
        """
        policy = RestartPolicy(restart, max_restarts, float(restart_window))
        budget = self.restart_budget
        healer = self_healing.healer_of(self)
        budget.policy = policy
        healer.start()  # it keeps the standby template warm while the policy is on
        return policy

    def events(self) -> list[RestartEvent]:
        """Every restart of this mesh by its policy (and a crash loop it gave up on), oldest
        first: ``RestartEvent`` records (``kind``, ``ranks``, ``causes``, ``seconds``...)."""
        h = self_healing.existing(self._ref.id)
        return list(h.events) if h is not None else []

    def wait_restart(self, after: int = 0, timeout: float = 60) -> RestartEvent:
        """Block until this mesh has an event numbered past ``after`` and return the first.

        Example::

            n = len(procs.events())
            os.kill(pid_of_rank_1, signal.SIGKILL)  # a rank dies
            event = procs.wait_restart(after=n)     # its replacement is up
        """
        return self_healing.healer_of(self).wait_restart(after, timeout)

    def replace_hung(self, ranks: list[int], timeout: float = 10) -> list[int]:
        """SIGKILL ``ranks`` (stuck ones: the watchdog's ``then="restart"``) and have the
        restart policy replace them, each death counted in its budget (reason "hung").
        Returns the ranks queued for replacement (none past the budget)."""
        if not self.restart_policy.on_failure:
            raise RuntimeError(f"mesh '{self.name}' has no restart policy: procs.set_restart_policy('on-failure') "
                               "first, or procs.kill(ranks) then procs.restart()")
        return self_healing.healer_of(self).replace_hung(list(ranks), timeout)

    def warm_standby(self) -> list[str]:
        """Have the template replaced ranks fork from import the heavy modules this mesh's
        ranks imported (torch, numpy...: the packages whose compiled files they mapped), so
        a replacement does not import them again; returns them.  The healer calls it every
        few seconds while the policy is "on-failure".  Ranks on other hosts: each host's agent
        keeps its own standby, and this returns what every one of them holds."""
        if self._owned is None:
            return []
        return Runtime.current().warm_standby(self._owned)
