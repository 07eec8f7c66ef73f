"""The data plane: ``RDMABuffer`` moves bytes rank to rank without the controller in the path;
``transports()`` says which transports this process can use and why the others are not.
Importing it must never start or install anything: a process's data server starts when it
registers its first buffer.
"""

from .buffer import RDMABuffer as RDMABuffer
from .errors import BufferDropped as BufferDropped
from .errors import ForgedHandle as ForgedHandle
from .errors import OwnerGone as OwnerGone
from .errors import RdmaSetupFailed as RdmaSetupFailed
from .errors import TransferError as TransferError
from .transports import transports as transports

__all__ = ["BufferDropped", "ForgedHandle", "OwnerGone", "RDMABuffer", "RdmaSetupFailed", "TransferError",
           "transports"]
