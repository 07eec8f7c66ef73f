"""``monarch_kernel.rdma``: the names of Monarch's ``monarch.rdma``, so that
``from monarch.rdma import ...`` ports by changing the module name.  It only re-exports
from ``data`` (where the data plane lives) and must never hold code of its own.
"""

from .data import RDMAAction as RDMAAction
from .data import RDMABuffer as RDMABuffer
from .data import RDMAReadTransferWarning as RDMAReadTransferWarning
from .data import RDMATcpFallbackWarning as RDMATcpFallbackWarning
from .data import RDMAWriteTransferWarning as RDMAWriteTransferWarning
from .data import get_rdma_backend as get_rdma_backend
from .data import is_ibverbs_available as is_ibverbs_available
from .data import transports as transports

# Monarch's __all__ (python/monarch/rdma/__init__.py), then this project's own.
__all__ = ["get_rdma_backend", "is_ibverbs_available", "RDMABuffer", "RDMAAction", "RDMAReadTransferWarning",
           "RDMATcpFallbackWarning", "RDMAWriteTransferWarning", "transports"]
