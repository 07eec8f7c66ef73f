"""What can go wrong moving bytes, each error saying which buffer and why, and the warning
classes Monarch's ``monarch.rdma`` exports.  Only exception and warning classes live here:
raising them is the callers' business, and this module must never import the rest of the
data plane.
"""

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


class RdmaSetupFailed(TransferError):
    """The owner could not set up its end of an ibverbs transfer (open its RDMA device,
    connect the queue pair, or register the buffer with the NIC); the message says which,
    on which device, and what to set instead."""


# Monarch exports these three and warns with them when GPU memory is staged through host
# memory or when no NIC is found.  Here staging and the shm/tcp transports are the designed
# path, not a degraded one, so nothing warns with them: they exist so that Monarch code
# that filters or catches them imports and runs unchanged.


class RDMAReadTransferWarning(Warning):
    """Monarch's warning about a read that is staged through host memory (never issued here).

    Example::

        import warnings
        warnings.simplefilter("ignore", RDMAReadTransferWarning)   # as in Monarch
    """


class RDMAWriteTransferWarning(Warning):
    """Monarch's warning about a write that is staged through host memory (never issued here).

    Example::

        import warnings
        warnings.simplefilter("ignore", RDMAWriteTransferWarning)   # as in Monarch
    """


class RDMATcpFallbackWarning(Warning):
    """Monarch's warning that no RDMA NIC was found (never issued here: shm and tcp are
    first-class transports; ``get_rdma_backend()`` says which kind is in use).

    Example::

        import warnings
        warnings.simplefilter("ignore", RDMATcpFallbackWarning)   # as in Monarch
    """
