"""The exceptions users catch.  They are defined next to the runtime's failure records (the
runtime raises them too) and re-exported here as the public names."""

from ..runtime.failure import ActorError, MeshFailure, MeshStopped, ProcessDied

__all__ = ["ActorError", "ProcessDied", "MeshStopped", "MeshFailure"]
