"""The ``ibverbs`` transport: one-sided RDMA READ/WRITE through a NIC.

The C extension (``native/ibverbs.c``) owns the hot path; this module wires it to the data
plane.  A reader opens the usual authenticated data connection to the owner and asks it to
connect a queue pair (``IB_CONNECT``); both sides swap lid/gid/qpn/psn over that socket,
the owner registers the buffer and answers with its address and rkey.  From then on each
transfer is a liveness check over the socket plus RDMA work requests: the owner's CPU never
touches the bytes.

Running it on a machine with a NIC needs nothing but ``libibverbs-dev`` at install time (so
the extension is built) and a device: ``monarch_kernel.data.transports()`` then lists
``ibverbs`` as available, and ``pytest tests/test_data.py -k ibverbs`` runs its tests.
``MONARCH_KERNEL_IB_DEVICE``/``_PORT``/``_GID_INDEX`` pick the device, port and GID (RoCE
usually needs the GID index of the RoCE v2 address).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import weakref

from . import wire

IB_CONNECT = 6
_endpoints: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # socket -> (Endpoint, {bid: (addr, rkey)})
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


def _endpoint():
    return _native().Endpoint(os.environ.get("MONARCH_KERNEL_IB_DEVICE") or None,
                              int(os.environ.get("MONARCH_KERNEL_IB_PORT", "1")),
                              int(os.environ.get("MONARCH_KERNEL_IB_GID_INDEX", "0")))


def _encode_info(info: dict) -> bytes:
    return json.dumps({**info, "gid": info["gid"].hex()}).encode()


def _decode_info(raw: bytes) -> dict:
    info = json.loads(raw)
    info["gid"] = bytes.fromhex(info["gid"])
    return info


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


# ---------------------------------------------------------------- owner side


def serve_connect(sock, reg, state: dict) -> None:
    """Answer ``IB_CONNECT`` for one buffer on one connection; ``state`` lives as long as it."""
    n = int.from_bytes(wire.recv_exact(sock, 4), "little")
    peer = _decode_info(wire.recv_exact(sock, n))
    try:
        ep = state.get("ep")
        if ep is None:
            ep = state["ep"] = _endpoint()
            ep.connect(**peer)
        regions = state.setdefault("regions", {})
        region = regions.get(reg.id)
        if region is None:
            region = regions[reg.id] = ep.register(address_of(reg.mem.view), reg.mem.nbytes)
    except OSError as e:
        wire.send_reply(sock, wire.RANGE, f"RDMA set-up failed on the owner: {e}".encode())
        return
    msg = json.dumps({"qp": json.loads(_encode_info(ep.info())), "addr": region.addr, "rkey": region.rkey})
    wire.send_reply(sock, wire.OK, msg.encode())


# ---------------------------------------------------------------- reader side


def transfer(h, key: bytes, op: int, mem, offset: int, timeout: float | None) -> None:
    from . import client

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
                info = _encode_info(ep.info())
                sock.sendall(wire.REQUEST.pack(IB_CONNECT, h.id, h.token, 0, 0) + len(info).to_bytes(4, "little") + info)
                status, msg = wire.recv_reply(sock)
                client._raise_for(h, status, msg)
                answer = json.loads(msg)
                if not remotes:
                    ep.connect(**_decode_info(json.dumps(answer["qp"]).encode()))
                remote = remotes[h.id] = (answer["addr"], answer["rkey"])
                with _lock:
                    _endpoints[sock] = (ep, remotes)
            client._request(sock, h, wire.CHECK, offset, view.nbytes)
            if view.nbytes == 0:
                return
            region = ep.register(address_of(view), view.nbytes)
            go = ep.read if op == wire.READ else ep.write
            go(region.addr, region.lkey, remote[0] + offset, remote[1], view.nbytes, timeout or 0.0)

    client._guard(h, run)
