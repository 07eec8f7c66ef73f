"""ZeroMQ sending: one outgoing socket per (thread, peer), signing on the sending thread.

Every thread sends on sockets of its own, so no send ever waits for another thread.
Inboxes (the receiving side) are in ``inbox.py``.
"""

from __future__ import annotations

import threading

import zmq

from .auth import Signer
from .envelope import Header


_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_COPY_BELOW = 1 << 16  # smaller frames are cheaper to copy than to share


def _size(f) -> int:
    return f.nbytes if type(f) is memoryview else len(f)


class _ThreadSockets(dict):
    """Outgoing sockets of one thread; closed when the thread's locals are freed."""

    def __del__(self):
        for s in self.values():
            try:
                s.close(linger=0)
            except Exception:  # interpreter shutdown: the context may already be gone
                pass


class Transport:
    def __init__(self, ctx: zmq.Context, signer: Signer):
        self.ctx = ctx
        self.signer = signer
        self._local = threading.local()
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.send_failures = 0

    def _socket(self, addr: str) -> zmq.Socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = _ThreadSockets()
        s = socks.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 10)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
            s.connect(addr)
            socks[addr] = s
        return s

    def send(self, addr: str, header: Header, body: list) -> bool:
        """Sign and send; False when the peer is unreachable (the caller handles death)."""
        frames = self.signer.sign(header, body)
        try:
            send = self._socket(addr).send
            last = len(frames) - 1
            for i, f in enumerate(frames):
                send(f, _MORE_NOBLOCK if i < last else _NOBLOCK, copy=_size(f) < _COPY_BELOW)
        except zmq.ZMQError:
            self.send_failures += 1
            return False
        self.sent += 1
        return True

    def forget(self, addr: str) -> None:
        """Close this thread's socket to a peer that is gone."""
        socks = getattr(self._local, "socks", None)
        if socks and addr in socks:
            socks.pop(addr).close(linger=0)
