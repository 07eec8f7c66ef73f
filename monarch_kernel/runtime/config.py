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


def data_transport() -> str | None:
    """MONARCH_KERNEL_DATA_TRANSPORT: force one data-plane transport (ibverbs, cuda_ipc, shm
    or tcp) instead of the best usable one per pair of ranks."""
    return os.environ.get("MONARCH_KERNEL_DATA_TRANSPORT") or None


def netns() -> str | None:
    """MONARCH_KERNEL_NETNS: a network namespace (name under /run/netns, or a path) that
    ranks enter before they start, to place them on separate simulated hosts."""
    return os.environ.get("MONARCH_KERNEL_NETNS") or None


def tcp_streams() -> int:
    """MONARCH_KERNEL_TCP_STREAMS: connections a tcp transfer of 8 MiB or more is split over
    (default 2: sender and receiver each copy two streams at once; measured 40-80% faster
    than one on a 2-core loopback, while three were slower than two)."""
    return max(1, int(os.environ.get("MONARCH_KERNEL_TCP_STREAMS", "2")))


def send_queue() -> int:
    """MONARCH_KERNEL_SEND_QUEUE: messages a thread may queue for one peer that is not
    reading before sends to it wait, then fail (default 1000)."""
    return max(1, int(os.environ.get("MONARCH_KERNEL_SEND_QUEUE", "1000")))


def send_block() -> float:
    """MONARCH_KERNEL_SEND_BLOCK: seconds a calling thread waits for room in a full queue
    before the call fails (default 5; the IO thread never waits)."""
    return float(os.environ.get("MONARCH_KERNEL_SEND_BLOCK", "5"))


def heartbeat_timeout() -> float:
    """MONARCH_KERNEL_HEARTBEAT_TIMEOUT: seconds without a heartbeat after which a rank is
    shown "not responding" (default 10; ranks beat every second)."""
    return float(os.environ.get("MONARCH_KERNEL_HEARTBEAT_TIMEOUT", "10"))


def max_line() -> int:
    """MONARCH_KERNEL_MAX_LINE: longest piece of one output line the controller holds, in
    bytes (default 1 MiB); a longer line reaches the output sink as pieces of this size."""
    return max(1024, int(os.environ.get("MONARCH_KERNEL_MAX_LINE", str(1 << 20))))


def data_bind_address() -> str | None:
    """MONARCH_KERNEL_DATA_BIND: the address data servers listen on for TCP peers (several
    comma-separated; 0.0.0.0 for every interface).  Unset: loopback when every rank of the job
    is on this host, else this network namespace's interface addresses (``hosts.py``)."""
    return os.environ.get("MONARCH_KERNEL_DATA_BIND") or None


def bind_address() -> str | None:
    """MONARCH_KERNEL_BIND: the address a process of a job that spans hosts listens on (its
    inboxes, its data server).  Unset: the address of its route to the controller; an agent
    sets it for the ranks it forks."""
    return os.environ.get("MONARCH_KERNEL_BIND") or None


def data_handshake_timeout() -> float:
    """MONARCH_KERNEL_DATA_HANDSHAKE_TIMEOUT: seconds a connection to a data server has, in
    all, to prove it holds the job key (default 5); read when the server starts."""
    return max(0.01, float(os.environ.get("MONARCH_KERNEL_DATA_HANDSHAKE_TIMEOUT", "5")))


def strict() -> bool:
    """MONARCH_KERNEL_STRICT=1: behave as Monarch where we deliberately differ (default off).
    An unhandled failure exits the controller with status 1 after it is reported, and an
    actor class mixing sync and async endpoints is refused at spawn with Monarch's
    ValueError.  Read at each use, so a test can set it in a subprocess."""
    return os.environ.get("MONARCH_KERNEL_STRICT", "").strip().lower() in ("1", "true", "yes", "on")
