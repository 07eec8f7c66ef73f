"""What can go wrong moving bytes, each error saying which buffer and why."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A read or write of an ``RDMABuffer`` failed."""


class BufferDropped(TransferError):
    """The buffer was dropped by its owner; get a fresh handle from it."""


class ForgedHandle(TransferError):
    """The handle was altered, forged, or belongs to an earlier incarnation of its owner."""


class OwnerGone(TransferError):
    """The process that owns the buffer has exited or cannot be reached."""

    def __init__(self, h, why: str):
        super().__init__(f"buffer {h.name!r}: its owner, {h.owner}, is gone: {why}")
