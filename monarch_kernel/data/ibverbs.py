"""The ``ibverbs`` transport: one-sided RDMA READ/WRITE through a NIC, owner half and reader
half, wired to the C extension (``native/ibverbs.c``) that owns the hot path.  It must never
let the owner's CPU touch the bytes, nor report a failed set-up as anything but its own error.
"""

from __future__ import annotations

import ctypes
import functools
import json
import socket
import threading
import weakref

from ..runtime import config
from . import client, wire

# A reader opens the usual authenticated data connection to the owner and asks it to connect
# a queue pair (IB_CONNECT); both sides swap lid/gid/qpn/psn over that socket, the owner
# registers the buffer and answers with its address and rkey.  From then on each transfer is
# a liveness check over the socket plus RDMA work requests.  A failed set-up on the owner is
# answered RDMA_SETUP, raised as RdmaSetupFailed, naming the device and the step that failed.
#
# Running it on a machine with a NIC needs nothing but libibverbs-dev at install time (so the
# extension is built) and a device: monarch_kernel.data.transports() then lists ibverbs as
# available, and `pytest tests/data/test_data.py -k ibverbs` runs its tests.
# MONARCH_KERNEL_IB_DEVICE/_PORT/_GID_INDEX pick the device, port and GID (RoCE usually needs
# the GID index of the RoCE v2 address).

_endpoints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # socket -> (Endpoint, {bid: (addr, rkey)})
_lock = threading.Lock()


def _native():
    from . import _ibverbs

    return _ibverbs


@functools.lru_cache(maxsize=1)
def is_available() -> tuple[bool, str]:
    try:
        native = _native()
    except ImportError as e:
        return False, (f"the native extension is not built ({e}); install libibverbs-dev "
                       "(and rdma-core) and reinstall monarch-kernel")
    return native.probe()


def _settings() -> tuple[str | None, int, int]:
    """The device (None: the first one), port and GID index this process uses."""
    return config.ib_device()


def _endpoint():
    return _native().Endpoint(*_settings())


def _encode_info(info: dict) -> bytes:
    return json.dumps({**info, "gid": info["gid"].hex()}).encode()


def _decode_info(raw: bytes) -> dict:
    info = json.loads(raw)
    info["gid"] = bytes.fromhex(info["gid"])
    return info


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


# ---------------------------------------------------------------- owner side


def serve_connect(sock: socket.socket, reg, blob: bytes, state: dict, owner: str) -> None:
    """Answer a checked ``IB_CONNECT`` for one buffer on one connection, whose reader sent its
    queue-pair details as ``blob``; ``state`` lives as long as the connection."""
    peer = _decode_info(blob)
    device, port, gid_index = _settings()
    where = f"RDMA device {device!r}" if device else "the first RDMA device (MONARCH_KERNEL_IB_DEVICE is unset)"
    step = f"opening {where}"
    try:
        ep = state.get("ep")
        if ep is None:
            ep = state["ep"] = _endpoint()
            step = f"connecting a queue pair on {where} to the reader's"
            ep.connect(**peer)
        regions = state.setdefault("regions", {})
        region = regions.get(reg.id)
        if region is None:
            step = f"registering the buffer's {reg.mem.nbytes} bytes with {where}"
            region = regions[reg.id] = ep.register(address_of(reg.mem.view), reg.mem.nbytes)
    except (OSError, ImportError) as e:
        wire.send_reply(sock, wire.Status.RDMA_SETUP, (
            f"buffer {reg.name!r}: RDMA set-up failed on its owner, {owner}, while {step} (port {port}, "
            f"GID index {gid_index}): {e}. Set MONARCH_KERNEL_IB_DEVICE (and _PORT, _GID_INDEX) on the "
            "owner to a device that works there (transports() lists them), or "
            "MONARCH_KERNEL_DATA_TRANSPORT=tcp").encode())
        return
    msg = json.dumps({"qp": json.loads(_encode_info(ep.info())), "addr": region.addr, "rkey": region.rkey})
    wire.send_reply(sock, wire.Status.OK, msg.encode())


# ---------------------------------------------------------------- reader side


def request_connect(sock: socket.socket, h, info: dict) -> dict:
    """Send this end's queue-pair details (``Endpoint.info()``) for ``h`` and return the
    owner's answer: ``{"qp": its details, "addr": ..., "rkey": ...}``; a failed set-up on the
    owner raises ``RdmaSetupFailed``."""
    answer = json.loads(client.request(sock, h, wire.Op.IB_CONNECT, 0, 0, _encode_info(info)))
    answer["qp"]["gid"] = bytes.fromhex(answer["qp"]["gid"])
    return answer


def transfer(h, key: bytes, op: wire.Op, mem, offset: int, timeout: float | None) -> None:
    view = mem.view
    if view.readonly:  # RDMA needs a registrable (writable) local buffer
        view = memoryview(bytearray(view))

    def run():
        with client.Connection(h, "tcp", key, timeout) as sock:
            with _lock:
                ep, remotes = _endpoints.get(sock, (None, {}))
            if ep is None:
                ep = _endpoint()
            remote = remotes.get(h.id)
            if remote is None:
                answer = request_connect(sock, h, ep.info())
                if not remotes:
                    ep.connect(**answer["qp"])
                remote = remotes[h.id] = (answer["addr"], answer["rkey"])
                with _lock:
                    _endpoints[sock] = (ep, remotes)
            client.request(sock, h, wire.Op.CHECK, offset, view.nbytes)
            if view.nbytes == 0:
                return
            region = ep.register(address_of(view), view.nbytes)
            go = ep.read if op == wire.Op.READ else ep.write
            go(region.addr, region.lkey, remote[0] + offset, remote[1], view.nbytes, timeout or 0.0)

    client.guarded(h, run)
