"""Sending: one outgoing socket per (thread, peer), signing on the sending thread; a peer on
this host is sent datagrams (``datagram.Links``), others go through ZeroMQ.

Every thread sends on sockets of its own, so no send ever waits for another thread.  The
queue to each peer is bounded (``MONARCH_KERNEL_SEND_QUEUE`` messages): a peer that stops
reading (SIGSTOP, stuck) makes senders wait a little and then fail loudly, never grow the
sender's memory without limit.  A send that fails raises ``SendFailed``; nothing is dropped
silently.  Inboxes (the receiving side) are in ``inbox.py``.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable

import zmq
from zmq.backend import zmq_poll

from .. import config
from ..errors import SendFailed
from ..limits import check_room
from ..wire.auth import Signer
from ..wire.curve import CurveKeys
from ..wire.envelope import Header
from ..wire.framing import CHUNK, pieces
from ..wire.native import sockets
from .datagram import Links

_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_POLLOUT = int(zmq.POLLOUT)
_COPY_BELOW = 1 << 16  # smaller frames are cheaper to copy than to share
# pyzmq's own send, under the sugar layer's checks for options we never use (routing ids,
# groups): it is called for every frame of every message.
_send = zmq.backend.Socket.send


def _size(f) -> int:
    return f.nbytes if type(f) is memoryview else len(f)


class _ThreadSockets(dict):
    """Outgoing sockets of one thread; closed when the thread's locals are freed."""

    seen = 0  # how many of the transport's forgotten peers this thread has dropped

    def __del__(self):
        for s in self.values():
            try:
                s.close(linger=0)
            except Exception:  # interpreter shutdown: the context may already be gone
                pass


class Transport:
    def __init__(self, ctx: zmq.Context, signer: Signer, *, io=None, curve: CurveKeys | None = None):
        """``io``: the process's IO thread (``use_io``); ``curve``: the job's Curve keys, if
        it has them from the start (``use_keys`` when they change)."""
        self.ctx = ctx
        self.signer = signer
        self._local = threading.local()
        self._lock = threading.Lock()
        self._gone: list[str] = []  # address prefixes of peers that are gone, oldest first
        self.io_thread: threading.Thread | None = None  # never blocks waiting for room
        self.inbox: zmq.Socket | None = None  # the runtime's main inbox (set by Runtime), for tools that poke at it
        self.curve: CurveKeys | None = curve  # the job's Curve keys, once it has hosts of its own
        self.queue_limit = config.send_queue()
        self.block_s = config.send_block()
        self.sent = 0
        self.received = 0  # messages read, heartbeats apart (heartbeats)
        self.heartbeats = 0
        self.send_failures = 0
        fast = sockets()
        self._send_first = fast.send if fast is not None else None  # libzmq's send, straight from C
        self.links: Links | None = None  # same-host datagram links (datagram.py), once the IO thread is known
        if io is not None:
            self.use_io(io)
        self._dialers: list[Callable[[str], str | None]] = []
        self._carriers: list[Callable[[str], str | None]] = []
        self._carried_by: dict[str, str | None] = {}  # addr -> its carrier, as the carriers said
        # A moved peer's old address -> its new one (``forward``); replaced whole, never
        # changed in place, so that a sending thread reads it without a lock.
        self.moved: dict[str, str] = {}
        self._owners: dict[str, str] = {}  # a forward's old address -> the moved rank's mesh (under the lock)
        if via := config.get("controller_via"):  # a host whose controller is reached through ssh
            self.add_dialer(loopback_for(via))

    def add_dialer(self, dial: Callable[[str], str | None],
                   carrier: Callable[[str], str | None] | None = None) -> Callable[[], None]:
        """``dial(addr)``: where to connect to reach the peer at ``addr`` (say, the local end of
        an ssh forward), or None to connect to ``addr`` itself.  Asked once per thread and
        peer, before connecting; a TCP peer stays a Curve server wherever it is reached.
        ``carrier(addr)``: the name of the one connection (an ssh connection's host) that
        carries what ``dial`` sends to ``addr``, or None (``carrier``).  Returns a function
        that removes both (connections already made stay)."""
        self._dialers.append(dial)
        if carrier is not None:
            self._carriers.append(carrier)
            self._carried_by = {}

        def remove() -> None:
            if dial in self._dialers:
                self._dialers.remove(dial)
            if carrier in self._carriers:
                self._carriers.remove(carrier)
                self._carried_by = {}

        return remove

    @property
    def carried(self) -> bool:
        """Whether some peers are reached through a carrier (``add_dialer``)."""
        return bool(self._carriers)

    def carrier(self, addr: str) -> str | None:
        """The connection that carries messages to ``addr`` (say, the ssh connection of an
        out-of-cluster host), or None when ``addr`` is dialed directly.  A call to many ranks
        sends each carrier one message, fanned out beyond it (``Caller.call``)."""
        if self.moved:  # a moved rank is carried by what carries its new address
            addr = self.moved.get(addr, addr)
        known = self._carried_by
        if addr in known:
            return known[addr]
        got = None
        for carrier in list(self._carriers):
            got = carrier(addr)
            if got:
                break
        if len(known) < 65536:  # peers' addresses stay; a mesh of many asks for each on every call
            known[addr] = got
        return got

    def route(self, addr: str) -> str:
        """Where to connect to reach the peer at ``addr`` (``dial``'s answer, or ``addr``): for
        connections of other planes (the data plane's sockets) that must go where these go."""
        return self._dial(addr)

    def _dial(self, addr: str) -> str:
        for dial in list(self._dialers):
            got = dial(addr)
            if got:
                return got
        return addr

    def use_keys(self, curve: CurveKeys) -> None:
        """The job's Curve keys changed (``Network.use_job_keys``): new links use them."""
        self.curve = curve

    def use_io(self, io) -> None:
        """The process's IO thread: it never waits for room, and it sends what waits in
        datagram links."""
        self.io_thread = io.thread
        if config.get("datagrams"):
            self.links = Links(io, self.queue_limit, self.block_s, self.forgotten, self.is_gone)

    def forgotten(self) -> int:
        """How many peers ``forget`` has been told are gone, so far."""
        return len(self._gone)

    def is_gone(self, addr: str, since: int = 0) -> bool:
        """Whether the peer at ``addr`` was forgotten after the first ``since`` (``forget``)."""
        with self._lock:
            return any(addr == p or addr.startswith(p + ".") for p in self._gone[since:])

    def _socket(self, addr: str) -> zmq.Socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = _ThreadSockets()
            socks.seen = len(self._gone)
        elif socks.seen != len(self._gone):
            self._purge(socks)
        s = socks.get(addr)
        if s is None:
            check_room(f"a connection to {addr}")
            # Dialed first: a dialer that fails (an ssh forward that cannot be made) leaves no socket behind.
            where = self._dial(addr) if self._dialers else addr
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.setsockopt(zmq.SNDHWM, self.queue_limit)
            s.setsockopt(zmq.RECONNECT_IVL, 10)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
            if self.curve is not None and addr.startswith("tcp://"):
                self.curve.connect_as_client(s)  # links between hosts: CurveZMQ as well as the HMAC
            s.connect(where)
            socks[addr] = s
        return s

    def _links_gone(self) -> list[str]:
        """Prefixes of peers gone since this thread's links last looked."""
        seen = getattr(self._local, "links_seen", 0)
        if seen == len(self._gone):
            return []
        with self._lock:
            gone, self._local.links_seen = self._gone[seen:], len(self._gone)
        return gone

    def _purge(self, socks: _ThreadSockets) -> None:
        with self._lock:
            gone, socks.seen = self._gone[socks.seen:], len(self._gone)
        for prefix in gone:
            for addr in [a for a in socks if a == prefix or a.startswith(prefix + ".")]:
                socks.pop(addr).close(linger=0)

    def send(self, addr: str, header: Header, body: list, *, block: bool = True) -> None:
        """Sign and queue one message for ``addr``.

        When the peer's queue is full, waits up to ``MONARCH_KERNEL_SEND_BLOCK`` seconds for
        room (``block=False``, for the IO thread: not at all), then raises ``SendFailed``.
        """
        if self.moved:  # empty unless a rank moved to another host: nothing to look up
            addr = self.moved.get(addr, addr)
        frames = self.signer.seal(header, body)
        links = self.links
        if links is not None and addr[:4] == "ipc:":
            if gone := self._links_gone():
                links.forget(gone)
            try:
                if links.send(addr, frames, block, self.signer.for_mesh(header.mesh).vouch):
                    self.sent += 1
                    return
            except SendFailed:
                self.send_failures += 1
                raise
            except OSError as e:  # check_room: too few descriptors left for its socket
                self.send_failures += 1
                raise SendFailed(f"cannot send to {addr}: {e.strerror}") from None
        try:
            sock = self._socket(addr)
            last = len(frames) - 1
            fast = self._send_first
            if fast is not None:  # the MAC, the header and the small parts: copied
                if not fast(sock.underlying, frames[0], _MORE_NOBLOCK if last else _NOBLOCK):
                    self._wait_for_room(sock, addr, header, block)
                    _send(sock, frames[0], _MORE_NOBLOCK if last else _NOBLOCK, True)
            else:
                try:
                    _send(sock, frames[0], _MORE_NOBLOCK if last else _NOBLOCK, True)
                except zmq.Again:
                    self._wait_for_room(sock, addr, header, block)
                    _send(sock, frames[0], _MORE_NOBLOCK if last else _NOBLOCK, True)
            # Once the first frame is queued, ZeroMQ takes the rest of the message whole.
            for i in range(1, last + 1):
                f = frames[i]
                n = _size(f)
                if n >= CHUNK:  # in pieces that each fit under the receiver's ZMQ_MAXMSGSIZE
                    cut = pieces(f)
                    for p in cut[:-1]:
                        _send(sock, p, _MORE_NOBLOCK, False)
                    f = cut[-1]
                _send(sock, f, _MORE_NOBLOCK if i < last else _NOBLOCK, _size(f) < _COPY_BELOW)
        except zmq.Again:
            self.send_failures += 1
            raise SendFailed(
                f"cannot send to {addr}: {self.queue_limit} messages are already queued for it and "
                f"it has read none for {self.block_s if block else 0:g} s; the process there is not "
                f"reading (stopped with SIGSTOP, stuck, or overloaded); see %mesh status, or raise "
                f"MONARCH_KERNEL_SEND_QUEUE") from None
        except OSError as e:  # check_room: too few descriptors left to connect; or a dialer's ConnectionError
            self.send_failures += 1
            raise SendFailed(f"cannot send to {addr}: {e.strerror or e}") from None
        except zmq.ZMQError as e:
            self.send_failures += 1
            hint = ""
            if e.errno in (errno.EMFILE, errno.ENFILE):
                hint = ("; the process is out of file descriptors or ZeroMQ sockets "
                        "(raise `ulimit -n`, or end threads and meshes that are no longer used)")
            raise SendFailed(f"cannot send to {addr}: {e.strerror}{hint}") from None
        self.sent += 1

    def _wait_for_room(self, sock: zmq.Socket, addr: str, header: Header, block: bool) -> None:
        if not block or threading.current_thread() is self.io_thread:
            raise zmq.Again()
        deadline = time.monotonic() + self.block_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise zmq.Again()
            if zmq_poll([(sock, _POLLOUT)], max(1, int(min(left, 0.1) * 1000))):
                return

    def forward(self, old: str, new: str, owner: str = "") -> None:
        """The peer that was at ``old`` is at ``new`` from now on (a rank restarted on another
        host): what is sent to ``old``, by any thread, goes to ``new``; so does what was
        forwarded to ``old`` (a peer that moved twice).  ``owner``: the moved rank's mesh,
        whose end drops the forward (``unforward``)."""
        with self._lock:
            moved = {k: (new if v == old else v) for k, v in self.moved.items() if k != new}
            if old != new:
                moved[old] = new
                if owner:
                    self._owners[old] = owner
            self._owners.pop(new, None)
            self.moved = moved

    def unforward(self, addresses=(), owner: str = "") -> None:
        """Drop the forwards from ``addresses`` (a live process is there now: a later bind of
        the same port on that host) and those of mesh ``owner`` (it ended: nobody calls its
        ranks again).  Ports are reused, so a forward kept past either would send a new
        process's messages to where an old one moved, and they would wait there for ever."""
        with self._lock:
            drop = {a for a in addresses if a in self.moved}
            if owner:
                drop |= {old for old, mesh in self._owners.items() if mesh == owner}
            if not drop:
                return
            self.moved = {k: v for k, v in self.moved.items() if k not in drop}
            for old in drop:
                self._owners.pop(old, None)

    def forwards(self) -> dict[str, str]:
        """Every move this process knows of, old address -> new (``forward``)."""
        return dict(self.moved)

    def forget(self, prefix: str) -> None:
        """Every thread closes its sockets to ``prefix`` and to the inboxes under it
        (``prefix.*``), on its next send: the peer is gone."""
        with self._lock:
            self._gone.append(prefix)
        socks = getattr(self._local, "socks", None)
        if socks is not None:
            self._purge(socks)
        if self.links is not None:
            self.links.forget(self._links_gone())


def loopback_for(via: str) -> Callable[[str], str | None]:
    """A dialer for MONARCH_KERNEL_CONTROLLER_VIA: ``IP`` reaches ``tcp://IP:PORT`` at
    ``tcp://127.0.0.1:PORT``, on a host whose ssh connection forwards each of the controller's
    ports to the same port of its loopback; ``IP@RELAY`` reaches it at ``tcp://RELAY:PORT``, a
    Slurm login node's relay of the same ports (``SlurmJob(login=...)``)."""
    ip, _, relay = via.partition("@")
    prefix = f"tcp://{ip}:"
    at = f"tcp://{relay or '127.0.0.1'}:"

    def dial(addr: str) -> str | None:
        return at + addr[len(prefix):] if addr.startswith(prefix) else None

    return dial
