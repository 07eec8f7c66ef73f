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

__all__ = ["ActorError", "ProcessDied", "MeshStopped", "MeshFailure", "WorkspaceReloadError"]


class WorkspaceReloadError(ImportError):
    """``sync_workspace`` copied the files, but re-importing raised on some ranks: an
    ``ImportError``, as a failed import is; ``summary`` is the sync's, to see what was sent."""

    def __init__(self, message: str, summary: WorkspaceSync):
        super().__init__(message)
        self.summary = summary
