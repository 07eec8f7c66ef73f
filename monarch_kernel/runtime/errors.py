"""The runtime's public exceptions: what a call, a spawn or a send raises to its caller.

In one place, as trio's ``_core/_exceptions.py``, so a reader finds what can be caught
without reading the runtime; ``actor/errors.py`` re-exports the public names, and the
runtime raises them too (a death, a bootstrap that raised, a stopped mesh), hence here
and not in ``actor/``.  The records they carry are plain data in ``failure.py``.
"""

from __future__ import annotations

from .failure import DeathInfo, RemoteFailure

REMOTE_TRACEBACK = "Traceback of where the remote call failed (most recent call last):"


class ActorError(Exception):
    """An endpoint raised on a rank.  ``__cause__`` is the original exception when it
    could be carried over; ``remote_traceback`` is the rank's traceback as text.

    Example::

        try:
            trainers.step.call(0).get()
        except ActorError as e:
            print(e.rank, e.__cause__)                # the rank, and its ZeroDivisionError
    """

    def __init__(self, failure: RemoteFailure, message: str | None = None):
        self.failure = failure
        self.rank = failure.rank
        self.actor = failure.actor
        self.method = failure.method
        self.remote_traceback = failure.traceback
        super().__init__(message or self._message(failure))

    @staticmethod
    def _message(f: RemoteFailure) -> str:
        # Monarch's leading line ("Actor call <actor>.<endpoint> failed.") and traceback
        # heading, which its users match on; between them, where it happened (rank, pid,
        # host), which Monarch does not say.
        where = f"{f.actor}.{f.method}" if f.method else f.actor
        tb = f.traceback.rstrip().replace("Traceback (most recent call last):", REMOTE_TRACEBACK)
        if REMOTE_TRACEBACK not in tb:
            tb = f"{REMOTE_TRACEBACK}\n{tb}" if tb else f"{REMOTE_TRACEBACK}\n{f.type_name}: {f.message}"
        return (
            f"Actor call {where} failed.\n"
            f" It raised on rank {f.rank} (pid {f.pid} on {f.host}): {f.type_name}: {f.message}\n"
            f" {tb}"
        )


class ProcessDied(ActorError):
    """A rank's process exited (or was killed) before it answered.

    Example::

        try:
            trainers.step.call(8).get()
        except ProcessDied as e:
            print(e)                          # the rank, its host, exit code or signal, last stderr lines
            procs.restart().get()
    """

    def __init__(self, death: DeathInfo, actor: str = "", method: str = ""):
        self.death = death
        self.exitcode = death.exitcode
        self.signal = death.signal
        self.pid = death.pid
        self.host = death.host
        self.stderr_tail = death.stderr_tail
        rf = RemoteFailure(death.rank, actor, method, "ProcessDied", death.how(), "",
                           death.host, death.pid)
        super().__init__(rf, death.describe())


class SendFailed(ConnectionError):
    """A message could not be queued for its peer (its queue is full, or this process is
    out of descriptors); the call that needed it fails at once with this."""


class PortTaken(ConnectionError):
    """A listen hook could not have this process's new port at the far end of its forward
    (an ssh forward, or a login node's relay, to the same port of another host, where another
    program holds it).  Raised by the hook; the runtime then listens at another port and tells
    every hook that one instead (``Network``), so it reaches the user only when no port serves."""


class MeshStopped(Exception):
    """The mesh was stopped; spawn a new one to keep working.

    Example::

        procs.stop().get()
        try:
            trainers.step.call(8).get()
        except MeshStopped:
            procs = this_host().spawn_procs(per_host={"gpus": 4})
    """
