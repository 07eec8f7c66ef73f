"""Settings read from the environment, each with the variable that changes it."""

from __future__ import annotations

import os


def fanout() -> int:
    """MONARCH_KERNEL_FANOUT: children per node of the multicast tree (default 8)."""
    return max(1, int(os.environ.get("MONARCH_KERNEL_FANOUT", "8")))


def max_frame() -> int:
    """MONARCH_KERNEL_MAX_FRAME: largest accepted frame in bytes (default 16 GiB)."""
    return int(os.environ.get("MONARCH_KERNEL_MAX_FRAME", str(16 << 30)))


def spawn_timeout() -> float:
    """MONARCH_KERNEL_SPAWN_TIMEOUT: seconds to wait for ranks to come up (default 60)."""
    return float(os.environ.get("MONARCH_KERNEL_SPAWN_TIMEOUT", "60"))
