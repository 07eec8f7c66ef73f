"""The ``ibverbs`` transport: RDMA READ/WRITE through a NIC, via the C extension in ``native/``.

Placeholder until the extension lands.
"""

from __future__ import annotations


def is_available() -> tuple[bool, str]:
    return False, "the native ibverbs extension is not built"


def transfer(h, key, op, mem, offset, timeout):
    raise RuntimeError("ibverbs transport unavailable")
