"""The tensor layer's public exceptions, in one place for whoever catches them.

Both halves raise them (the controller's fetch, the rank's collectives), so they sit at the
top of tensors/, beside ``messages.py``.  Pure Python: no torch at import.
"""

from __future__ import annotations

from .messages import Poisoned


class RemoteException(Exception):
    """A distributed tensor's value failed on a rank: the op that failed there, the rank and
    its traceback.  Later ops still run; only what depends on the failed value is poisoned::

        with procs.activate():
            bad = x @ torch.ones(5, 5)      # a shape the controller could not check
        inspect(bad)                          # RemoteException: ... on rank 0 ...
    """

    def __init__(self, poisoned: Poisoned):
        self.rank, self.what, self.remote_traceback = poisoned.rank, poisoned.what, poisoned.traceback
        super().__init__(f"{poisoned.what} failed on rank {poisoned.rank}; its traceback there:\n"
                         f"{poisoned.traceback.rstrip()}")

    def __reduce__(self):
        return (_remote_exception, (self.rank, self.what, self.remote_traceback))


def _remote_exception(rank: int, what: str, traceback: str) -> RemoteException:
    return RemoteException(Poisoned(rank, what, traceback))


class PeerFailed(RuntimeError):
    """A collective or a move whose input failed on another rank: raised on every peer at
    once (its result poisoned, naming the rank to look at) rather than waiting for bytes
    that will never come."""

    def __init__(self, origin: int, members: tuple, what: str = "this reduction"):
        self.origin = origin
        super().__init__(f"the input of a member of {what} (ranks {list(members)}) failed on rank {origin}; "
                         f"inspect that tensor on rank {origin} for the op that failed and its traceback")
