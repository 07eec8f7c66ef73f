"""The store torchrun's agent hosts for its workers, hosted here by the mesh's RANK 0: torch's
own ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, on a socket bound to that address alone (the
loopback on one host), where torch's would listen on every interface.  Every rank's
``init_process_group()`` connects to it as a client (``TORCHELASTIC_USE_AGENT_STORE``), as
under torchrun.  Like torchrun's, it has no authentication: whoever reaches the address may
read and write its keys, so it holds nothing but torch's rendezvous.

A store lives while the default group made over it does; a new one is served for each
set-up (fresh keys, as torchrun gives each restart).  Runs on ranks; imports torch only
when it serves a store.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import sys
import threading
from typing import Any

from ...runtime import config

_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}  # (MASTER_ADDR, MASTER_PORT) -> its TCPStore (the server)
_group: dict[str, Any] = {"on": None, "used": set()}  # on: the store the default group was made over


def serve(addr: str, port: int = 0) -> int:
    """Serve a store at ``addr:port`` (``port`` 0: a free one), unless this process already
    serves one there whose keys no finished group used; returns its port."""
    with _lock:
        key, live = (addr, int(port)), _live()
        if port and key in _servers and (key not in _group["used"] or key == live):
            return int(port)
        _drop(lambda k: k != live)  # earlier set-ups' stores, unless the live group was made over one
        listener = _listen(addr, int(port))
        import torch.distributed as dist

        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns it from here, and closes it
        try:
            timeout = datetime.timedelta(seconds=config.seconds("spmd_setup_timeout"))
            store = dist.TCPStore(addr, port, is_master=True, master_listen_fd=fd, wait_for_workers=False,
                                  timeout=timeout, use_libuv=True)
        except BaseException:
            os.close(fd)
            raise
        _servers[(addr, port)] = store
        return port


def ensure(addr: str, port: int) -> None:
    """A store at ``addr:port`` served here, unless there is one already (whatever it holds)."""
    with _lock:
        if (addr, int(port)) in _servers:
            return
    serve(addr, port)


def group_made(addr: str, port: int) -> None:
    """This process's default group was made over the store at ``addr:port``."""
    with _lock:
        _group["on"] = (addr, int(port))
        _group["used"].add((addr, int(port)))


def group_gone() -> None:
    """This process's default group was destroyed or aborted: its store (if here) goes, so
    that no later group meets the keys it left."""
    with _lock:
        on, _group["on"] = _group["on"], None
        if on is not None:
            _drop(lambda key: key == on)


def close_unused() -> None:
    """Stop every store served here that no live group was made over: a group being made
    over one fails its rendezvous at once, on every rank (``elastic_run`` aborts a
    rebuild so when a member dies during it)."""
    with _lock:
        live = _live()
        _drop(lambda key: key != live)


def listening() -> list[tuple[str, int]]:
    """The ``(address, port)`` of each store served here."""
    with _lock:
        return list(_servers)


def _live() -> tuple[str, int] | None:
    dist = sys.modules.get("torch.distributed")
    alive = dist is not None and dist.is_available() and dist.is_initialized()
    return _group["on"] if alive else None


def _drop(which) -> None:
    for key in [k for k in _servers if which(k)]:
        del _servers[key]  # the server stops, and closes its socket, with its last reference
        _group["used"].discard(key)


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr`` alone, or an error that says what to pass instead."""
    try:
        family, _type, _proto, _name, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(f"MASTER_ADDR {addr!r} does not resolve on rank 0's host ({socket.gethostname()}): {e}; "
                         "pass master_addr=None for the address the ranks reach rank 0 on") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(where)
        s.listen(1024)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError(f"MASTER_PORT {port} is in use on {addr} (rank 0's host {socket.gethostname()}): "
                               "pass another master_port, or None for a free one") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"MASTER_ADDR {addr!r} is not an address of rank 0's host ({socket.gethostname()}), "
                             "which serves the store torch's ranks meet at; pass one of its addresses, or "
                             "master_addr=None") from None
        raise
    return s
