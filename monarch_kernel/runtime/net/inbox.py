"""Inboxes: PULL sockets read directly by the thread that waits on them, each with a unix
datagram socket beside it for processes of the same host (``datagram.Listener``, read
first).

A process has one main inbox (read by the IO thread), one per thread that makes calls (its
replies come straight back to that thread, so a blocking ``.get()`` wakes exactly one
thread), and one per hosted actor (read by the actor's worker, so a call to a sync endpoint
never passes through the IO thread).  A lease lock lets the IO thread take over a thread's
inbox when nobody is blocked on it (``await``, callbacks, a thread that exited).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable

import zmq
from zmq.backend import zmq_poll

from .. import config
from ..wire import native
from ..wire.curve import CurveKeys
from ..wire.framing import CHUNK, join
from .datagram import Listener, path_of

# Plain ints: pyzmq's flag enums cost more to combine than the calls they modify.
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_RCVMORE = int(zmq.RCVMORE)
# The first frame (the MAC, the header and the small parts; see framing.py) is received as
# bytes: cheaper than a zmq.Frame for small messages; the large frames after it as Frames.
_recv = zmq.backend.Socket.recv


class Inbox:
    """``address`` is where it listens (``tcp://ip:*`` picks a port; TCP binds serve Curve with
    ``curve``); ``net_address``, once ``listen_tcp`` ran, is a second, TCP, address of the
    same socket for peers on other hosts (``net_ip`` its IP; ``former``: the TCP addresses it
    listened on before, still bound, when the process moved to another IP).  ``vouched``:
    whether a same-host message's first piece was begun with a key of the job
    (``Signer.vouched``; see ``datagram.Listener``)."""

    __slots__ = ("sock", "address", "net_address", "net_ip", "former", "lease", "missed", "watched", "_timeout_ms",
                 "_ptr", "_recv", "dg", "items", "__weakref__")

    def __init__(self, ctx: zmq.Context, address: str, curve: CurveKeys | None = None, *,
                 vouched: Callable[[bytes, bytes], bool]):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        # A frame longer than this is refused while ZeroMQ reads its length, never buffered:
        # the runtime's own large frames come in pieces (framing.CHUNK) that fit.
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_wire_frame())
        tcp = address.startswith("tcp://")
        if tcp and curve is not None:
            curve.serve(self.sock)
        # Datagrams first: a sender finds them whenever it finds the ZeroMQ socket (datagram.py).
        path = path_of(address) if config.get("datagrams") else None
        self.dg: Listener | None = Listener(path, config.max_frame(), vouched) if path is not None else None
        try:
            self.sock.bind(address)
        except BaseException:
            if self.dg is not None:
                self.dg.close()
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.net_address: str | None = self.address if tcp else None
        self.net_ip: str | None = _ip(self.address) if tcp else None
        self.former: tuple[str, ...] = ()
        self.lease = threading.Lock()
        self.missed = False  # the IO thread found it readable while someone else held it
        self.watched = False  # the IO thread polls it too
        self._timeout_ms = -1  # the socket's receive timeout (RCVTIMEO), as last set
        fast = native.sockets()
        self._ptr = self.sock.underlying  # libzmq's socket, for the C receive
        self._recv = fast.recv if fast is not None else None
        self.items = [(self.sock, _POLLIN)] + ([(self.dg.fileno(), _POLLIN)] if self.dg is not None else [])

    def fds(self) -> list[int]:
        """What a selector watches for this inbox."""
        return [self.sock.getsockopt(zmq.FD)] + ([self.dg.fileno()] if self.dg is not None else [])

    def listen_tcp(self, ip: str, curve: CurveKeys | None) -> str:
        """Also listen on ``tcp://ip:<free port>`` (a Curve server when ``curve`` is given;
        the ipc bind keeps its plain options); returns that address.  Listening on another IP
        keeps the old address bound (``former``) for the peers that hold it."""
        if self.net_address is None or self.net_ip != ip:
            if self.net_address is None and curve is not None:
                curve.serve(self.sock)
            self.sock.bind(f"tcp://{ip}:*")
            if self.net_address is not None:
                self.former += (self.net_address,)
            self.net_address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.net_ip = ip
        return self.net_address

    def relisten_tcp(self) -> str:
        """Listen at another free port of ``net_ip`` instead of ``net_address``, which no one
        was given yet (``Network``: a listen hook could not forward it); returns the new address."""
        assert self.net_address is not None and self.net_ip is not None
        taken = self.net_address
        self.sock.bind(f"tcp://{self.net_ip}:*")  # first: the port just left is not picked again
        self.sock.unbind(taken)
        self.net_address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.address == taken:
            self.address = self.net_address
        return self.net_address

    def owns(self, address: str) -> bool:
        """Whether ``address`` is one this inbox listens on."""
        return address == self.address or address == self.net_address or address in self.former

    def recv(self):
        """One message's frames, or None when nothing is waiting."""
        if self.dg is not None:
            got = self.dg.receive()
            if got is not None:
                return got
        sock = self.sock
        if self._recv is not None:
            got = self._recv(self._ptr, _NOBLOCK)
            if got is None:
                return None
            return _rest(sock, got[0]) if got[1] else [got[0]]
        try:
            f = _recv(sock, _NOBLOCK, True)
        except zmq.Again:
            return None
        return _rest(sock, f) if sock.get(_RCVMORE) else [f]

    def recv_within(self, timeout_ms: int):
        """One message's frames, waiting up to ``timeout_ms`` in the receive itself (a poll
        first would cost a second wake-up per message); None when none came."""
        if self.dg is not None:
            got = self.recv()
            if got is not None:
                return got
            if not zmq_poll(self.items, timeout_ms):
                return None
            return self.recv()
        sock = self.sock
        if timeout_ms != self._timeout_ms:
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._timeout_ms = timeout_ms
        if self._recv is not None:
            got = self._recv(self._ptr, 0)
            if got is None:
                return None
            return _rest(sock, got[0]) if got[1] else [got[0]]
        try:
            f = _recv(sock, 0, True)
        except zmq.Again:
            return None
        return _rest(sock, f) if sock.get(_RCVMORE) else [f]

    def ready(self, timeout_ms: int = 0) -> bool:
        """Whether a message is waiting (after up to ``timeout_ms``; -1 waits forever)."""
        return bool(zmq_poll(self.items, timeout_ms))

    def close(self) -> None:
        self._recv = None  # (its libzmq socket is gone)
        self.sock.close(linger=0)
        if self.dg is not None:
            self.dg.close()


def _rest(sock: zmq.Socket, first: bytes) -> list:
    """The frames of a message whose first frame ``first`` was just read, and more follow
    (a large frame's pieces joined back: ``framing.join``)."""
    frames: list = [first]
    pieced = False
    while True:
        f = sock.recv(0, copy=False)
        frames.append(f)
        pieced = pieced or len(f) == CHUNK
        if not f.more:
            return join(frames) if pieced else frames


@functools.lru_cache(maxsize=4096)
def actor_address(base: str, actor: str) -> str:
    """Where an actor's inbox on the rank whose main inbox is ``base`` listens.  A rank on a
    TCP address has one port: its actors' calls reach the main inbox, which hands them on."""
    if base.startswith("tcp://"):
        return base
    return f"{base}.{hashlib.blake2b(actor.encode(), digest_size=5).hexdigest()}"


def _ip(address: str) -> str:
    return address[len("tcp://"):].rsplit(":", 1)[0]
