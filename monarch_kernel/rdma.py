"""``from monarch_kernel.rdma import RDMABuffer``: the spelling Monarch users know."""

from .data import RDMABuffer as RDMABuffer
from .data import transports as transports

__all__ = ["RDMABuffer", "transports"]
