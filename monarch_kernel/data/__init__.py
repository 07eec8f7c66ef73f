"""The data plane: ``RDMABuffer`` moves bytes rank to rank without the controller in the path;
``RDMAAction`` batches such transfers; ``transports()`` says which transports this process
can use and why the others are not.  Importing it must never start or install anything: a
process's data server starts when it registers its first buffer.
"""

from .action import RDMAAction as RDMAAction
from .buffer import RDMABuffer as RDMABuffer
from .errors import BufferDropped as BufferDropped
from .errors import ForgedHandle as ForgedHandle
from .errors import OwnerGone as OwnerGone
from .errors import RDMAReadTransferWarning as RDMAReadTransferWarning
from .errors import RdmaSetupFailed as RdmaSetupFailed
from .errors import RDMATcpFallbackWarning as RDMATcpFallbackWarning
from .errors import RDMAWriteTransferWarning as RDMAWriteTransferWarning
from .errors import TransferError as TransferError
from .transports import get_rdma_backend as get_rdma_backend
from .transports import is_ibverbs_available as is_ibverbs_available
from .transports import transports as transports

__all__ = ["BufferDropped", "ForgedHandle", "OwnerGone", "RDMAAction", "RDMABuffer", "RDMAReadTransferWarning",
           "RDMATcpFallbackWarning", "RDMAWriteTransferWarning", "RdmaSetupFailed", "TransferError",
           "get_rdma_backend", "is_ibverbs_available", "transports"]
