"""Tensors moved point to point between ranks of a mesh (``to_mesh`` between its slices).

Between ranks of one host (same kernel, pid and network namespaces) a CPU tensor is copied
once, straight out of the source's memory into the destination's (``process_vm_readv``),
after a small header on the pair's local link (``links.py``) says where it is; the source
waits for the destination's word that it is done.  Measured on a loaded 2-core machine, 2.4x
gloo's send/recv at 4 MiB, 1.5x at 64 MiB.  Between hosts, and where the kernel refuses the
direct copy (ptrace rules, seccomp), the bytes go over gloo, each pair in a two-rank group
of its own (``groups.py``); CUDA tensors over nccl.  It must never read a peer's memory
other than the range the peer named for this transfer.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import struct
import threading
from typing import Any

from ...runtime import config
from . import buffers
from .groups import Groups
from .links import Links, recv_exact
from .peer_failed import PeerFailed, flag, raise_if_flagged

log = logging.getLogger(__name__)
DATA = 3  # the gloo tag of a transfer's bytes
FLAG = 4  # ... and of the word sent beside them: 0, or 1 + the rank on which the source's input failed
_HEADER = struct.Struct("!qqq")  # on the link, source to destination: pid (or -1 - the failed rank), address, bytes
_ACK = struct.Struct("!q")  # ... and back: 0 (copied), an errno (copy the bytes over gloo instead), or:
SIZE_MISMATCH = -1  # the destination expected another size; nothing moves
MODES = ("direct", "gloo")


class Transfers:
    """One rank's transfers over one rendezvous; ``mode``: ``"direct"``, ``"gloo"``, or None for
    the best per pair (it must be the same on every rank)."""

    def __init__(self, groups: Groups, rank: int, mode: str | None = None):
        mode = mode if mode is not None else config.tensor_transfer()
        if mode is not None and mode not in MODES:
            raise ValueError(f"transfer={mode!r}: choose 'direct' (same host, one copy), 'gloo', or None for the "
                             "best per pair (MONARCH_KERNEL_TENSOR_TRANSFER)")
        self.mode = mode
        self._groups, self._rank = groups, rank
        self._me = _identity()
        self._peers: dict[int, str] = {}
        self._no_direct: set[int] = set()
        self._lock = threading.Lock()
        groups.store.set(groups.key("peer", rank), self._me)
        _allow_peers_to_read()

    def direct_with(self, peer: int) -> bool:
        """Whether CPU tensors to or from ``peer`` are copied straight between the two
        processes (the same answer on both sides)."""
        if self.mode == "gloo" or peer in self._no_direct:
            return False
        with self._lock:
            ident = self._peers.get(peer)
        if ident is None:
            ident = self._groups.store.get(self._groups.key("peer", peer)).decode()
            with self._lock:
                self._peers[peer] = ident
        return not self._me.startswith("-/") and ident.split("/")[:3] == self._me.split("/")[:3]

    def run(self, local: Any, pairs: list[tuple[int, int]], like: Any, stream: str, failed: int | None = None) -> Any:
        """``failed``: this rank's input failed (on rank ``failed``); ``local`` is then a
        stand-in of its shape, and each destination raises ``PeerFailed`` at once rather
        than waiting for bytes that will not come."""
        import torch

        me = self._rank
        dests = [d for _s, d in pairs]
        if len(set(dests)) != len(dests):
            raise ValueError(f"a destination receives one tensor; {pairs} names one twice")
        sends = [d for s, d in pairs if s == me and d != me]
        source = next((s for s, d in pairs if d == me), None)
        if (sends or source == me) and not isinstance(local, torch.Tensor):
            raise TypeError(f"rank {me} sends in {pairs}, so it needs its tensor, not {type(local).__name__}")
        if source is not None and source != me and like is None:
            raise TypeError(f"rank {me} receives in {pairs}: pass like= (a tensor of the shape and dtype it gets)")
        mine = local.clone(memory_format=torch.contiguous_format) if source == me else None
        if source == me:
            source = None  # what this rank keeps is copied; it may still send to others
        if not sends and source is None:
            return mine
        data: Any = local.contiguous() if sends else None
        out: Any = None
        if source is not None:
            device = like.device if like.device.type != "meta" else torch.device("cpu")
            out = buffers.empty(like.shape, like.dtype, device)
        device = (data if data is not None else out).device
        members = tuple(sorted({r for pair in pairs for r in pair if pair[0] != pair[1]}))
        backend = self._groups.backend(members, me, device)
        if backend == "nccl":
            self._nccl(pairs, data, out, stream, failed)
        elif device.type == "cuda":  # ranks sharing a GPU (NCCL refuses them): host copies over gloo
            staged = out.cpu() if out is not None else None
            self._gloo(sends, source, data.cpu() if data is not None else None, staged, stream, failed)
            if out is not None:
                out.copy_(staged)
        else:
            self._gloo(sends, source, data, out, stream, failed)
        return mine if mine is not None else out

    def _pair(self, peer: int, backend: str, stream: str):
        members = (min(self._rank, peer), max(self._rank, peer))
        return self._groups.group(members, self._rank, backend, stream), members.index(peer)

    def _nccl(self, pairs, data, out, stream: str, failed: int | None) -> None:
        works, flags = [], []
        for s, d in pairs:  # one order on every rank: each pair's send meets its recv
            if s == self._rank and d != s:
                pg, i = self._pair(d, "nccl", stream)
                works += [pg.send([flag(failed, data.device)], i, FLAG), pg.send([data], i, DATA)]
            elif d == self._rank and s != d:
                pg, i = self._pair(s, "nccl", stream)
                flags.append((s, flag(None, out.device)))
                works += [pg.recv([flags[-1][1]], i, FLAG), pg.recv([out], i, DATA)]
        for w in works:
            w.wait()
        for s, word in flags:
            raise_if_flagged(word, (s, self._rank), "this move")

    def _gloo(self, sends: list[int], source: int | None, data: Any, out: Any, stream: str,
              failed: int | None) -> None:
        works: list = []
        failure: Exception | None = None
        raw: Any = _as_bytes(data) if data is not None else None
        dst: Any = _as_bytes(out) if out is not None else None
        word: Any = None  # the flag word that comes with bytes over gloo
        direct_in = source is not None and self.direct_with(source)
        if source is not None and not direct_in:  # 1. post what arrives over gloo
            word = self._recv_gloo(source, dst, stream, works)
        waiting = []
        for d in sends:  # 2. send: where the bytes are (on the link), or the bytes (over gloo)
            if self.direct_with(d):
                link = self._link(d, stream)
                who = os.getpid() if failed is None else -1 - failed
                link.sendall(_HEADER.pack(who, raw.data_ptr(), raw.numel()))
                waiting.append((d, link))
            else:
                self._send_gloo(d, raw, failed, stream, works)
        if direct_in and source is not None:  # 3. copy out of the source's memory, then say so
            link = self._link(source, stream)
            pid, addr, nbytes = _HEADER.unpack(recv_exact(link, _HEADER.size))
            if pid < 0:  # the source's input failed: nothing to copy
                status = 0
                failure = PeerFailed(-1 - pid, (source, self._rank), "this move")
            else:
                status = SIZE_MISMATCH if nbytes != dst.numel() else _read_peer(pid, addr, dst)
            link.sendall(_ACK.pack(status))
            if status == SIZE_MISMATCH:
                failure = ValueError(f"rank {source} sends {nbytes} bytes, but rank {self._rank} expects "
                                     f"{dst.numel()} (shape {tuple(out.shape)}, {out.dtype})")
            elif status:
                self._fall_back(source, status)
                word = self._recv_gloo(source, dst, stream, works)
        for d, link in waiting:  # 4. hold the bytes until each destination has them
            status = _ACK.unpack(recv_exact(link, _ACK.size))[0]
            if status == SIZE_MISMATCH:
                failure = failure or ValueError(f"rank {d} expected another size than the {raw.numel()} bytes "
                                                f"rank {self._rank} sends")
            elif status:
                self._fall_back(d, status)
                self._send_gloo(d, raw, failed, stream, works)
        for w in works:
            w.wait()
        if failure is not None:
            raise failure
        if word is not None and source is not None:
            raise_if_flagged(word, (source, self._rank), "this move")

    def _send_gloo(self, dest: int, raw: Any, failed: int | None, stream: str, works: list) -> None:
        pg, i = self._pair(dest, "gloo", stream)
        works += [pg.send([flag(failed, raw.device)], i, FLAG), pg.send([raw], i, DATA)]

    def _recv_gloo(self, source: int, dst: Any, stream: str, works: list) -> Any:
        pg, i = self._pair(source, "gloo", stream)
        word = flag(None, dst.device)
        works += [pg.recv([word], i, FLAG), pg.recv([dst], i, DATA)]
        return word

    def _link(self, peer: int, stream: str):
        return Links.shared(self._groups, self._rank).get(peer, int(self._peers[peer].rsplit("/", 1)[1]), stream)

    def _fall_back(self, peer: int, status: int) -> None:
        if peer not in self._no_direct:
            log.warning("copying tensors straight from rank %d's memory failed (%s): they go over gloo "
                        "instead (allow ptrace between the ranks, e.g. kernel.yama.ptrace_scope=0, for one copy)",
                        peer, os.strerror(status) if status > 0 else status)
        self._no_direct.add(peer)


def _as_bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def _identity() -> str:
    """``boot/pid-namespace/net-namespace/pid``: two processes with the same first three
    parts can name each other's memory by pid, and reach each other's abstract sockets."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns, netns = os.stat("/proc/self/ns/pid").st_ino, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"-/-/-/{os.getpid()}"  # not Linux: never direct
    return f"{boot}/{pidns}/{netns}/{os.getpid()}"


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_size_t), ("len", ctypes.c_size_t)]


@functools.cache
def _readv():
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def _read_peer(pid: int, addr: int, dst: Any) -> int:
    """Copy ``dst.numel()`` bytes at ``addr`` in process ``pid`` into ``dst``: 0, or the errno."""
    fn = _readv()
    if fn is None:
        return errno.ENOSYS
    n, base, done = dst.numel(), dst.data_ptr(), 0
    while done < n:
        loc, rem = _Iovec(base + done, n - done), _Iovec(addr + done, n - done)
        got = fn(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
        if got <= 0:
            return ctypes.get_errno() or errno.EIO
        done += got
    return 0


@functools.cache
def _allow_peers_to_read() -> None:
    """Under Yama's ptrace_scope=1, let this host's ranks read what this rank names to them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except (OSError, AttributeError):
        pass
