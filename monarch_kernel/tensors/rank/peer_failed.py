"""The word sent beside a collective's or a move's data: whether its input failed, and where.

A rank whose input failed takes part anyway, with a stand-in and this word, so every peer
raises ``PeerFailed`` (``tensors/errors.py``) at once instead of waiting for bytes that
will never come.
"""

from __future__ import annotations

from typing import Any

from ..errors import PeerFailed


def flag(failed: int | None, device: Any) -> Any:
    """The word sent beside the data: 0, or 1 + the rank on which the input failed."""
    import torch

    return torch.tensor([0 if failed is None else failed + 1], dtype=torch.int64, device=device)


def raise_if_flagged(word: Any, members: tuple, what: str = "this reduction") -> None:
    """``PeerFailed`` when the word that arrived names a failed input."""
    origin = int(word.item()) - 1
    if origin >= 0:
        raise PeerFailed(origin, members, what)
