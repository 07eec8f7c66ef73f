"""``PeerFailed``: a collective or a move whose input failed on another rank.

That rank takes part anyway, with a stand-in and the word that its input failed, so every
peer fails at once (its result poisoned, naming the rank to look at) instead of waiting
for bytes that will never come.
"""

from __future__ import annotations

from typing import Any


class PeerFailed(RuntimeError):
    def __init__(self, origin: int, members: tuple, what: str = "this reduction"):
        self.origin = origin
        super().__init__(f"the input of a member of {what} (ranks {list(members)}) failed on rank {origin}; "
                         f"inspect that tensor on rank {origin} for the op that failed and its traceback")


def flag(failed: int | None, device: Any) -> Any:
    """The word sent beside the data: 0, or 1 + the rank on which the input failed."""
    import torch

    return torch.tensor([0 if failed is None else failed + 1], dtype=torch.int64, device=device)


def raise_if_flagged(word: Any, members: tuple, what: str = "this reduction") -> None:
    """``PeerFailed`` when the word that arrived names a failed input."""
    origin = int(word.item()) - 1
    if origin >= 0:
        raise PeerFailed(origin, members, what)
