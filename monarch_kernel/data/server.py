"""The owner's side of the data plane: registered buffers and the server that serves them.

Started the first time a process registers a buffer.  It listens on a Unix socket (peers on
this host) and on TCP (peers elsewhere); every connection first proves it holds the job key
(``wire.py``), then asks for ranges of a buffer by id and secret token.  Each connection has
its own thread, so concurrent readers are served in parallel and a slow peer holds up nobody.

Anyone who can reach the port can connect, so a neighbour must not be able to stop the
server: accept errors (out of descriptors, memory) are waited out, never fatal; connections
still proving the key are capped per peer and in all (the excess is turned away before a
thread is spent on it); and a handshake has one deadline for the whole exchange.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from ..runtime import config, hosts
from ..runtime.context import process_mesh
from . import ibverbs, wire
from .memory import Memory, move_to_shared

NOT_SHARED = 6
# Connections still in their handshake: at most this many in all, and from one peer (a TCP
# address, or a process on the Unix socket).  A handshake takes a millisecond; a reader opens
# at most a few dozen connections at once, and one turned away tries again.
MAX_UNAUTHENTICATED = 128
MAX_UNAUTHENTICATED_PER_PEER = 32
# accept() errors that mean "out of something for now": wait, then go on.
_SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKOFF_MAX_S = 0.5


@dataclass
class Registered:
    id: int
    name: str
    mem: Memory
    token: bytes
    shared: tuple[int, int, int] | None  # (fd, storage bytes, offset) for the shm transport
    lock: threading.Lock = field(default_factory=threading.Lock)


class DataServer:
    _current: "DataServer | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "DataServer":
        with cls._lock:
            if cls._current is None or cls._current.pid != os.getpid():
                from ..runtime.process import Runtime

                cls._current = cls(Runtime.current())
            return cls._current

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
        _allow_peers_to_read()
        # Whether peers may ask for a queue pair (CPU memory only; GPU memory needs dmabuf).
        self.rdma = ibverbs.is_available()[0]
        for sock, via in [(self._unix, "unix")] + [(t, "tcp") for t in self._tcp]:
            threading.Thread(target=self._accept, args=(sock, via), daemon=True,
                             name=f"mk-data-{via}").start()
        atexit.register(self.close)

    # ------------------------------------------------------------ registry

    def register(self, mem: Memory, name: str | None) -> Registered:
        bid = next(self._ids)
        shared = move_to_shared(mem) if mem.device == "cpu" else None
        reg = Registered(bid, name or f"buffer-{bid}", mem, secrets.token_bytes(16), shared)
        self.buffers[bid] = reg
        return reg

    def drop(self, bid: int) -> None:
        reg = self.buffers.pop(bid, None)
        if reg is not None:
            self.dropped[bid] = reg.name
            if reg.shared is not None:
                # torch keeps its own descriptor for the storage; the segment is freed
                # with the tensor, and no name of it exists in /dev/shm.
                reg.shared = None

    def check(self, op: int, bid: int, token: bytes, offset: int, nbytes: int) -> tuple[int, str, Registered | None]:
        reg = self.buffers.get(bid)
        if reg is None:
            if bid in self.dropped:
                return wire.GONE, f"buffer {self.dropped[bid]!r} was dropped by its owner, {self.owner}", None
            return wire.FORGED, f"{self.owner} has no buffer #{bid}: the handle is forged or from another process", None
        if not hmac.compare_digest(token, reg.token):
            return wire.FORGED, f"wrong token for buffer {reg.name!r}: the handle is forged", None
        if offset < 0 or nbytes < 0 or offset + nbytes > reg.mem.nbytes:
            return (wire.RANGE, f"bytes {offset}..{offset + nbytes} are outside buffer {reg.name!r} "
                                f"of {reg.mem.nbytes} bytes", None)
        if op == wire.WRITE and reg.mem.readonly:
            return wire.READONLY, f"buffer {reg.name!r} was registered read-only", None
        return wire.OK, "", reg

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
            finally:
                self._admitted(peer)
            sock.settimeout(None)
            rdma: dict = {}  # this connection's queue pair and registered regions, if any
            while True:
                try:
                    head = wire.recv_exact(sock, wire.REQUEST.size)
                except ConnectionError:
                    return
                self._handle(sock, via, rdma, *wire.REQUEST.unpack(head))
        except (OSError, wire.HandshakeFailed):
            return
        finally:
            sock.close()

    def _handle(self, sock: socket.socket, via: str, rdma: dict, op: int, bid: int, token: bytes,
                offset: int, nbytes: int) -> None:
        status, why, reg = self.check(op, bid, token, offset, nbytes)
        if op == ibverbs.IB_CONNECT:
            if status != wire.OK:
                n = int.from_bytes(wire.recv_exact(sock, 4), "little")
                wire.recv_exact(sock, n)  # the peer's queue-pair details, unused
            else:
                ibverbs.serve_connect(sock, reg, rdma)
                return
        if status != wire.OK:
            wire.send_reply(sock, status, why.encode())
            return
        if op == wire.READ:
            wire.send_reply(sock, wire.OK)
            if nbytes:
                if reg.mem.device == "cpu":
                    sock.sendall(reg.mem.view[offset:offset + nbytes])
                else:
                    sock.sendall(_cuda_to_host(reg.mem, offset, nbytes))
        elif op == wire.WRITE:
            wire.send_reply(sock, wire.OK)
            if nbytes:
                if reg.mem.device == "cpu":
                    wire.recv_into_all(sock, reg.mem.view[offset:offset + nbytes])
                else:
                    staging = bytearray(nbytes)
                    wire.recv_into_all(sock, memoryview(staging))
                    _host_to_cuda(reg.mem, offset, staging)
            wire.send_reply(sock, wire.OK)
        elif op == wire.MAP and reg.mem.device != "cpu":
            # A fresh IPC handle per peer: torch counts the processes using the storage.
            handle = _cuda_handle(reg.mem) if via == "unix" else None
            wire.send_reply(sock, wire.OK if handle else NOT_SHARED, json.dumps({"cuda": handle}).encode())
        elif op == wire.MAP:
            if via != "unix" or (reg.shared is None and reg.mem.readonly):
                wire.send_reply(sock, NOT_SHARED, b"not in shared memory")
            elif reg.shared is not None:
                fd, size, base = reg.shared
                msg = json.dumps({"size": size, "offset": base}).encode()
                socket.send_fds(sock, [wire.REPLY.pack(wire.OK, len(msg)) + msg], [fd])
            else:
                addr = ctypes.addressof(ctypes.c_char.from_buffer(reg.mem.view)) if reg.mem.nbytes else 0
                wire.send_reply(sock, wire.OK, json.dumps({"pid": self.pid, "addr": addr}).encode())
        elif op == wire.CHECK:
            wire.send_reply(sock, wire.OK)
        elif op == wire.DROP:
            self.drop(bid)
            wire.send_reply(sock, wire.OK)
        else:
            wire.send_reply(sock, wire.RANGE, f"unknown operation {op}".encode())

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


def _allow_peers_to_read() -> None:
    """Under Yama's ptrace_scope=1, let peers on this host read registered memory directly
    (process_vm_readv); they still need the buffer's token from this server first."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- CUDA helpers


def _cuda_handle(mem: Memory):
    """torch's CUDA IPC handle for the tensor's storage, for peers on this host."""
    t = mem.tensor
    storage = t.untyped_storage()
    try:
        handle = storage._share_cuda_()
    except RuntimeError:
        return None
    offset = t.data_ptr() - storage.data_ptr()
    return [_jsonable(x) for x in handle], offset


def _jsonable(x):
    return {"b": x.hex()} if isinstance(x, bytes) else x


def _cuda_bytes(mem: Memory):
    import torch

    return mem.tensor.detach().reshape(-1).view(torch.uint8)


def _cuda_to_host(mem: Memory, offset: int, nbytes: int) -> memoryview:
    host = _cuda_bytes(mem)[offset:offset + nbytes].cpu()
    return memoryview(host.numpy())


def _host_to_cuda(mem: Memory, offset: int, data: bytearray) -> None:
    import torch

    src = torch.frombuffer(data, dtype=torch.uint8)
    _cuda_bytes(mem)[offset:offset + len(data)].copy_(src)
