"""The owner's generic half of the data plane: registered buffers, and the server that admits
connections, checks each request's buffer, token and range, and hands it to its transport.
It must never stop serving because of what a neighbour does, nor move bytes itself.
"""

from __future__ import annotations

import atexit
import errno
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from ..runtime import config, hosts, process_mesh, rejects
from . import cuda_ipc, ibverbs, liveness, shm, tcp, wire
from .memory import Memory

# Started the first time a process registers a buffer.  It listens on a Unix socket (peers
# on this host) and on TCP (peers elsewhere); every connection first proves it holds the job
# key (wire.py), then asks for ranges of a buffer by id and secret token.  Each connection
# has its own thread, so concurrent readers are served in parallel and a slow peer holds up
# nobody.
#
# Anyone who can reach the port can connect, so a neighbour must not be able to stop the
# server: accept errors (out of descriptors, memory) are waited out, never fatal;
# connections still proving the key are capped per peer and in all (the excess is turned
# away before a thread is spent on it); and a handshake has one deadline for the whole
# exchange.

# Connections still in their handshake: at most this many in all, and from one peer (a TCP
# address, or a process on the Unix socket).  A handshake takes a millisecond; a reader opens
# at most a few dozen connections at once, and one turned away tries again.
MAX_UNAUTHENTICATED = 128
MAX_UNAUTHENTICATED_PER_PEER = 32
# accept() errors that mean "out of something for now": wait, then go on.
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKOFF_MAX_S = config.seconds("data_accept_backoff")


@dataclass
class Registered:
    id: int
    name: str
    mem: Memory
    token: bytes
    shared: tuple[int, int, int] | None  # (fd, storage bytes, offset) for the shm transport
    lock: threading.Lock = field(default_factory=threading.Lock)


class DataServer:
    """This process's registered buffers and the threads that serve them; one per process,
    made by ``get()`` the first time a buffer is registered."""

    _current: DataServer | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> DataServer:
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():
                from ..runtime import Runtime

                cls._current = cls(Runtime.current())
            return cls._current

    @classmethod
    def running(cls) -> DataServer | None:
        """This process's server if it has started one (never one inherited through fork)."""
        server = cls._current
        return server if server is not None and server.pid == os.getpid() else None

    def __init__(self, rt):
        self.pid = os.getpid()
        self.key = rt.key
        self.instance = secrets.token_bytes(8)
        self.host = hosts.host_key()
        mesh, rank = process_mesh
        self.owner = (f"rank {rank} of mesh {mesh.name!r}" if mesh is not None and mesh.name != "this_proc"
                      else "the controller") + f" (pid {self.pid})"
        self.buffers: dict[int, Registered] = {}
        self.dropped: dict[int, str] = {}
        self._ids = iter(range(1, 1 << 62))
        self._closed = False
        self.unix_path = os.path.join(rt.rundir, f"d{self.pid}-{self.instance.hex()[:8]}.sock")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.unix_path)
        self._unix.listen(64)
        self.handshake_timeout = config.data_handshake_timeout()
        self._pending: dict[object, int] = {}  # peer -> connections still in their handshake
        self._pending_lock = threading.Lock()
        self._tcp, self.tcp_port, self.addresses = _listen_tcp()
        self.live = liveness.Words()  # peers on this host see a drop without asking (liveness.py)
        shm.allow_peers_to_read()
        # Whether peers may ask for a queue pair (CPU memory only; GPU memory needs dmabuf).
        self.rdma = ibverbs.is_available()[0]
        for sock, via in [(self._unix, "unix")] + [(t, "tcp") for t in self._tcp]:
            threading.Thread(target=self._accept, args=(sock, via), daemon=True,
                             name=f"mk-data-{via}").start()
        atexit.register(self.close)

    # ------------------------------------------------------------ registry

    def register(self, mem: Memory, name: str | None) -> Registered:
        bid = next(self._ids)
        shared = shm.move_to_shared(mem) if mem.device == "cpu" else None
        reg = Registered(bid, name or f"buffer-{bid}", mem, secrets.token_bytes(16), shared)
        self.buffers[bid] = reg
        self.live.set(bid)
        return reg

    def drop(self, bid: int) -> None:
        reg = self.buffers.pop(bid, None)
        if reg is not None:
            self.live.clear(bid)  # before the DROP is answered: no later read on this host copies
            self.dropped[bid] = reg.name
            if reg.shared is not None:
                # torch keeps its own descriptor for the storage; the segment is freed
                # with the tensor, and no name of it exists in /dev/shm.
                reg.shared = None

    def check(self, op: int, bid: int, token: bytes, offset: int,
              nbytes: int) -> tuple[wire.Status, str, Registered | None]:
        """Whether ``op`` may touch ``nbytes`` at ``offset`` of buffer ``bid``: a status, why
        not, and the registration when it may."""
        reg = self.buffers.get(bid)
        if reg is None:
            if bid in self.dropped:
                return wire.Status.GONE, f"buffer {self.dropped[bid]!r} was dropped by its owner, {self.owner}", None
            return (wire.Status.FORGED, f"{self.owner} has no buffer #{bid}: the handle is forged or from "
                                        "another process", None)
        if not hmac.compare_digest(token, reg.token):
            return wire.Status.FORGED, f"wrong token for buffer {reg.name!r}: the handle is forged", None
        if offset < 0 or nbytes < 0 or offset + nbytes > reg.mem.nbytes:
            return (wire.Status.RANGE, f"bytes {offset}..{offset + nbytes} are outside buffer {reg.name!r} "
                                f"of {reg.mem.nbytes} bytes", None)
        if op == wire.Op.WRITE and reg.mem.readonly:
            return wire.Status.READONLY, f"buffer {reg.name!r} was registered read-only", None
        return wire.Status.OK, "", reg

    # ------------------------------------------------------------ serving

    def _accept(self, listener: socket.socket, via: str) -> None:
        """Accept until the server is closed, whatever accept() or a peer does meanwhile."""
        backoff = 0.0
        while not self._closed:
            try:
                sock, addr = listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of descriptors or memory: they come back as connections end.  Anything
                # else (a connection aborted before it was accepted) is one peer's trouble.
                backoff = min(max(2 * backoff, 0.01), _BACKOFF_MAX_S) if e.errno in _SCARCE else 0.01
                time.sleep(backoff)
                continue
            backoff = 0.0
            peer = _peer(sock, addr, via)
            if not self._admit(peer):
                rejects.count("data", "busy", f"too many connections still proving the key ({peer})", logging.DEBUG)
                wire.turn_away(sock)
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, via, peer), daemon=True,
                                 name="mk-data-conn").start()
            except RuntimeError:  # can't start new thread: as scarce as descriptors
                self._admitted(peer)
                wire.turn_away(sock)
                time.sleep(_BACKOFF_MAX_S)

    def _admit(self, peer) -> bool:
        with self._pending_lock:
            if (sum(self._pending.values()) >= MAX_UNAUTHENTICATED
                    or self._pending.get(peer, 0) >= MAX_UNAUTHENTICATED_PER_PEER):
                return False
            self._pending[peer] = self._pending.get(peer, 0) + 1
            return True

    def _admitted(self, peer) -> None:
        """``peer``'s connection has finished its handshake, one way or the other."""
        with self._pending_lock:
            n = self._pending.pop(peer) - 1
            if n:
                self._pending[peer] = n

    def unauthenticated(self) -> int:
        """Connections still proving they hold the job key."""
        with self._pending_lock:
            return sum(self._pending.values())

    def _serve(self, sock: socket.socket, via: str, peer) -> None:
        try:
            try:
                if via == "tcp":
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                wire.server_handshake(sock, self.key, time.monotonic() + self.handshake_timeout)
            except (OSError, wire.HandshakeFailed) as e:
                why = "timeout" if isinstance(e, TimeoutError) else "handshake"
                rejects.count("data", why, f"a connection from {peer} ({via}): {e}")
                return
            finally:
                self._admitted(peer)
            sock.settimeout(None)
            rdma: dict = {}  # this connection's queue pair and registered regions, if any
            while True:
                try:
                    req = wire.recv_request(sock)
                except ConnectionError:
                    return
                self._handle(sock, via, rdma, req)
        except (OSError, wire.HandshakeFailed):
            return
        finally:
            sock.close()

    def _handle(self, sock: socket.socket, via: str, rdma: dict, req: wire.Request) -> None:
        """Check one request, then hand it to the transport that serves its op."""
        op, offset, nbytes = req.op, req.offset, req.nbytes
        status, why, reg = self.check(op, req.bid, req.token, offset, nbytes)
        if op == wire.Op.IB_CONNECT:
            blob = wire.recv_blob(sock)  # the peer's queue-pair details, read whatever the status
            if status == wire.Status.OK:
                ibverbs.serve_connect(sock, reg, blob, rdma, self.owner)
                return
        if status != wire.Status.OK:
            wire.send_reply(sock, status, why.encode())
            return
        assert reg is not None  # check() returns the registration whenever the status is OK
        if op == wire.Op.READ:
            tcp.serve_read(sock, reg.mem, offset, nbytes)
        elif op == wire.Op.WRITE:
            tcp.serve_write(sock, reg.mem, offset, nbytes)
        elif op == wire.Op.MAP and reg.mem.device != "cpu":
            cuda_ipc.serve_map(sock, reg.mem, via)
        elif op == wire.Op.MAP:
            shm.serve_map(sock, reg.mem, reg.shared, via)
        elif op == wire.Op.CHECK:
            wire.send_reply(sock, wire.Status.OK)
        elif op == wire.Op.LIVE and via == "unix":
            socket.send_fds(sock, [wire.Reply(wire.Status.OK, b"").encode()], [self.live.fd])
        elif op == wire.Op.DROP:
            self.drop(req.bid)
            wire.send_reply(sock, wire.Status.OK)
        else:
            wire.send_reply(sock, wire.Status.RANGE, f"unknown operation {op}".encode())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in (self._unix, *self._tcp):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            s.close()
        try:
            os.unlink(self.unix_path)
        except OSError:
            pass


def _listen_tcp() -> tuple[list[socket.socket], int, tuple[str, ...]]:
    """Listeners on one port at each address ``hosts.data_listen_addresses()`` names, the
    port, and the addresses to advertise (those that could be bound, best first)."""
    bind, advertise = hosts.data_listen_addresses()
    listeners: list[socket.socket] = []
    port, failed = 0, {}
    for addr in bind:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))  # the first picks the port; the others take the same one
        except OSError as e:
            s.close()
            failed[addr] = e
            continue
        s.listen(64)
        port = s.getsockname()[1]
        listeners.append(s)
    if not listeners:
        why = "; ".join(f"{a}: {e.strerror or e}" for a, e in failed.items())
        raise OSError(f"the data server cannot listen on {why}; set MONARCH_KERNEL_DATA_BIND "
                      "to an address of this host")
    return listeners, port, tuple(a for a in advertise if a not in failed)


def _peer(sock: socket.socket, addr, via: str):
    """Who a connection is from, for the per-peer cap: its address, or its process."""
    if via == "tcp":
        return addr[0]
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        pid = 0
    return ("unix", pid)
