"""The actor layer's public exceptions, in one place for whoever catches them.

``ActorError``, ``ProcessDied`` and ``MeshStopped`` are defined in ``runtime/errors.py``
(the runtime raises them too) and re-exported here, as is the ``MeshFailure`` record a
supervisor is handed; the errors only this layer raises are defined here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime import ActorError, MeshFailure, MeshStopped, ProcessDied

if TYPE_CHECKING:
    from .code_sync.workspace import WorkspaceSync

__all__ = ["ActorError", "HangError", "ProcessDied", "MeshStopped", "MeshFailure", "WorkspaceReloadError"]


class HangError(Exception):
    """The hang watchdog (``%mesh watchdog T --then abort``, ``spmd.watchdog(procs, T,
    then="abort")``) saw no progress on a mesh for ``waited`` seconds and tore the hung work
    down: ``ranks`` are the ones the others waited for, ``where`` says where each was stuck,
    ``report`` is the file with every rank's stacks and collectives.  The mesh stays usable.

    Example::

        with spmd.watchdog(procs, 60, then="abort"):
            try:
                trainers.train.call(steps=1000).get()
            except HangError as e:
                print(e.ranks, e.where, e.report)   # who held the others up, where, the full report
    """

    def __init__(self, message: str, *, mesh: str, ranks: list[int], where: dict[int, str], waited: float,
                 report: str | None):
        super().__init__(message)
        self.mesh, self.ranks, self.where, self.waited, self.report = mesh, ranks, where, waited, report

    def __reduce__(self):
        return _hang_error, (str(self), self.mesh, self.ranks, self.where, self.waited, self.report)


def _hang_error(message, mesh, ranks, where, waited, report) -> HangError:
    return HangError(message, mesh=mesh, ranks=ranks, where=where, waited=waited, report=report)


class WorkspaceReloadError(ImportError):
    """``sync_workspace`` copied the files, but re-importing raised on some ranks: an
    ``ImportError``, as a failed import is; ``summary`` is the sync's, to see what was sent."""

    def __init__(self, message: str, summary: WorkspaceSync):
        super().__init__(message)
        self.summary = summary
