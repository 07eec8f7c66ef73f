"""``PeerFailed``: a collective or a move whose input failed on another rank.

That rank takes part anyway, with a stand-in and the word that its input failed, so every
peer fails at once (its result poisoned, naming the rank to look at) instead of waiting
for bytes that will never come.
"""

from __future__ import annotations


class PeerFailed(RuntimeError):
    def __init__(self, origin: int, members: tuple, what: str = "this reduction"):
        self.origin = origin
        super().__init__(f"the input of a member of {what} (ranks {list(members)}) failed on rank {origin}; "
                         f"inspect that tensor on rank {origin} for the op that failed and its traceback")
