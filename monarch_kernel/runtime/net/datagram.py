"""Same-host links over unix datagram sockets: one thread's message reaches an inbox on this
host in one system call each way, with no ZeroMQ I/O thread on either side.  A round trip
between two processes here takes about 15 us this way, against 100-150 us over ZeroMQ's
ipc transport, which hands each message to an I/O thread on both sides.

An inbox that listens on ``ipc://PATH`` also binds a datagram socket at ``PATH`` + "d"
(``Listener``).  Each thread's ``Link`` to it keeps the order of what that thread sends:

- a message with several frames, or too large for one datagram, goes packed, in pieces if
  need be, which the listener joins again (pieces carry their link's id, and the first one the
  message's length and a MAC of its head with the job key, ``Signer.vouch``: a process without
  the key begins no message a listener would hold; ``unfinished.py`` bounds what a listener
  holds of unfinished messages);
- when the peer's queue is full, what follows waits in the link's own queue (up to
  ``send_queue`` datagrams, as ZeroMQ's would), and the IO thread sends it as the peer reads;
- until the inbox is there (an actor's, say, which its rank makes once it reads the spawn),
  what is sent waits in the link, and the IO thread connects it as soon as it can;
- when the peer goes away (its socket refuses), that thread's messages to the inbox go
  through ZeroMQ from then on, for good, as they always did to a peer that is gone.  A
  listener reads its datagrams before its ZeroMQ messages, so nothing is reordered.

What a datagram holds is checked like any message (``Signer.open``) before anything in it
is unpickled; a datagram that is not a message of this wire is dropped there.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from .. import config
from ..errors import SendFailed
from ..limits import check_room
from ..wire import rejects
from ..wire.auth import VOUCH_LEN
from .unfinished import WIRE, Joiner

log = logging.getLogger("monarch_kernel.runtime")

DGRAM_MAX = 200_000  # bytes in one datagram (the kernel's default socket buffer is 208 KiB)
_BUF = 4 << 20  # each socket's buffer (capped by net.core.[rw]mem_max)
_PATH_MAX = 107  # sun_path, less its terminating NUL

# A datagram's first byte.  A message in pieces: FIRST (link id, the message's length, the
# vouch of those three, data), PIECE (link id, data)..., LAST (link id, data).
WHOLE, PACKED, PIECE, LAST, FIRST = 0, 1, 2, 3, 4
_TAG = [bytes([t]) for t in range(5)]
_ID = struct.Struct("<Q")
_COUNT = struct.Struct("<I")
_LEN = struct.Struct("<Q")
_STEP = DGRAM_MAX - _ID.size  # data in each piece after the first
_FIRST_STEP = _STEP - _LEN.size - VOUCH_LEN  # data in the first (it also carries the length, vouched)
_LONGEST = DGRAM_MAX + 1  # the longest datagram this wire sends (a piece): anything longer is not of it
_AT_DATA = 1 + _ID.size  # where a piece's data starts
_AT_VOUCH = _AT_DATA + _LEN.size  # a first piece's head (tag, link id, length) ends here
_AT_FIRST_DATA = _AT_VOUCH + VOUCH_LEN
# The most a message in pieces may be: the largest frame a process accepts, and its header.
_ENVELOPE = 1 << 20
RETRY_FIRST_S = config.seconds("datagram_retry")
RETRY_MAX_S = config.seconds("datagram_retry_max")
_PEEK = socket.MSG_PEEK | socket.MSG_TRUNC
_REFUSED = (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, NotADirectoryError)


def path_of(address: str) -> str | None:
    """Where the inbox at ``address`` takes datagrams; None for one that does not."""
    if not address.startswith("ipc://"):
        return None
    path = address[6:] + "d"
    return path if len(path.encode()) <= _PATH_MAX else None


def _pack(frames: list) -> bytes:
    sizes = [f.nbytes if type(f) is memoryview else len(f) for f in frames]
    head = _COUNT.pack(len(frames)) + b"".join(_LEN.pack(n) for n in sizes)
    return b"".join([head, *frames])


def _unpack(data) -> list:
    """The frames of a packed message; ``[data]`` (which the signer drops) when malformed."""
    mv = memoryview(data)
    try:
        (n,) = _COUNT.unpack_from(mv, 0)
        at = _COUNT.size + n * _LEN.size
        if n == 0 or at > len(mv):
            return [data]
        frames = []
        for i in range(n):
            (size,) = _LEN.unpack_from(mv, _COUNT.size + i * _LEN.size)
            frames.append(bytes(mv[at:at + size]) if i == 0 else mv[at:at + size])
            at += size
        return frames if at == len(mv) else [data]
    except struct.error:
        return [data]


class Listener:
    """The datagram side of one inbox; read by whoever holds the inbox's lease.
    ``vouched(head, mac)``: whether a first piece's head was vouched for with a key of the
    job (``Signer.vouched``)."""

    def __init__(self, path: str, max_message: int, vouched: Callable[[bytes, bytes], bool]):
        self.path = path
        self.max_message = max_message
        self.vouched = vouched
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUF)
            sock.setblocking(False)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._peek = bytearray(1)  # a datagram's length is peeked, then it is read whole: no buffer kept
        self._joiner = Joiner(max_message + _ENVELOPE, config.get("unfinished_timeout"), _FIRST_STEP, _STEP,
                              config.get("unfinished_memory"))
        self.unfinished = self._joiner.open  # its unfinished messages, by link id

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list | None:
        """The frames of the next whole message, or None when none is waiting."""
        sock, peek = self.sock, self._peek
        while True:
            try:
                n = sock.recv_into(peek, 1, _PEEK)  # MSG_TRUNC: the datagram's whole length
                if n > _LONGEST:  # not of this wire: read into one byte, so never buffered
                    sock.recv_into(peek, 1)
                    rejects.count(WIRE, "oversized", f"a datagram of {n} bytes (at most {_LONGEST})")
                    continue
                data = sock.recv(max(n, 1))
            except (BlockingIOError, InterruptedError):
                if self.unfinished:
                    self._joiner.drained()
                return None
            if n == 0:
                continue
            tag = data[0]
            if tag == WHOLE:
                if self.unfinished:
                    self._look()
                return [data[1:]]
            if tag == PACKED:
                if self.unfinished:
                    self._look()
                return _unpack(data[1:])
            if tag == FIRST and n > _AT_FIRST_DATA:
                if not self.vouched(data[:_AT_VOUCH], data[_AT_VOUCH:_AT_FIRST_DATA]):
                    # Not begun by a process of the job: held nowhere, and its pieces are orphans.
                    rejects.count(WIRE, "forged", "a message's first piece without the job key's MAC")
                    continue
                (total,) = _LEN.unpack_from(data, _AT_DATA)
                self._joiner.first(data[1:_AT_DATA], total, memoryview(data)[_AT_FIRST_DATA:], n)
                continue
            if (tag == PIECE or tag == LAST) and n > _AT_DATA:
                got = self._joiner.piece(data[1:_AT_DATA], memoryview(data)[_AT_DATA:], n, tag == LAST)
                if got is not None:
                    if self.unfinished:
                        self._look()
                    return _unpack(got)
                continue
            return [data]  # not of this wire: the signer drops it, and counts it

    def _look(self) -> None:
        """(Only while messages are unfinished.) Whether the socket is empty now: if it is,
        every piece sent here so far has been read, and unfinished messages may age."""
        try:
            self.sock.recv_into(self._peek, 1, _PEEK)
        except (BlockingIOError, InterruptedError):
            self._joiner.drained()

    def close(self) -> None:
        self.sock.close()
        self._joiner.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _datagrams(frames: list, link_id: bytes, vouch: Callable[[bytes], bytes]) -> list:
    """The datagrams (each a list of buffers for ``sendmsg``) that carry one message;
    ``vouch(head)``: the MAC of a first piece's head (``Signer.vouch``)."""
    if len(frames) == 1:
        f = frames[0]
        if (f.nbytes if type(f) is memoryview else len(f)) < DGRAM_MAX:
            return [[_TAG[WHOLE], f]]
    packed = _pack(frames)
    n = len(packed)
    if n < DGRAM_MAX:
        return [[_TAG[PACKED], packed]]
    view = memoryview(packed)
    head = _TAG[FIRST] + link_id + _LEN.pack(n)
    out = [[head, vouch(head), view[:_FIRST_STEP]]]
    out += [[_TAG[PIECE], link_id, view[i:i + _STEP]] for i in range(_FIRST_STEP, n, _STEP)]
    out[-1][0] = _TAG[LAST]
    return out


class Link:
    """One thread's datagram socket to one inbox, and what waits for room there.  Until the
    inbox exists (an actor's is made once its rank reads the spawn), what is sent waits in
    ``pending`` and the IO thread tries to connect every few milliseconds."""

    __slots__ = ("address", "path", "epoch", "sock", "id", "pending", "lock", "room", "zmq", "watching",
                 "__weakref__")

    def __init__(self, address: str, path: str | None, epoch: int = 0):
        self.address = address
        self.path = path
        self.epoch = epoch  # how many peers the transport had forgotten when it was made
        self.sock: socket.socket | None = None  # None: not connected yet (or ``zmq``)
        self.id = os.urandom(_ID.size)
        self.pending: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        self.zmq = path is None  # its messages go through ZeroMQ
        self.watching = False  # the IO thread waits to send what is pending
        if path is not None:
            self.connect()

    def connect(self) -> bool:
        """(Holding the lock, or before anyone shares the link.) Whether it is connected now."""
        if self.path is None:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF)
            sock.setblocking(False)
            sock.connect(self.path)
        except OSError:
            sock.close()
            return False
        self.sock = sock
        return True

    def close(self) -> None:
        with self.lock:
            self.zmq = True
            self.pending.clear()
            self.room.notify_all()
            if self.sock is not None and not self.watching:  # else the IO thread closes it
                self.sock.close()
                self.sock = None

    def __del__(self):
        if self.sock is not None:
            self.sock.close()


class Links:
    """This process's datagram links, one set per thread; the IO thread sends what waits."""

    def __init__(self, io, queue_limit: int, block_s: float, forgotten=lambda: [], gone=lambda address, since: False):
        self.io = io
        self.queue_limit = queue_limit
        self.block_s = block_s
        # The transport's record of peers that are gone: how many so far, and whether the peer
        # at an address went after the first ``since`` of them (a rank restarted in place comes
        # back at its old address, so only what went after a link was made counts against it).
        self.forgotten = forgotten
        self.gone = gone
        self._local = threading.local()

    def _links(self) -> dict:
        links = getattr(self._local, "links", None)
        if links is None:
            links = self._local.links = {}
        return links

    def send(self, address: str, frames: list, block: bool, vouch: Callable[[bytes], bytes]) -> bool:
        """Send one message to the inbox at ``address`` (``vouch``: the ``Signer.vouch`` of the
        key it was signed with); False when this thread's messages there go through ZeroMQ
        (then the caller sends it so)."""
        links = self._links()
        link = links.get(address)
        if link is None:
            check_room(f"a connection to {address}")
            link = links[address] = Link(address, path_of(address), self.forgotten())
            if link.sock is None and not link.zmq:  # nothing there yet: wait for it
                self.io.call_soon(self._retry, link, RETRY_FIRST_S)
        if link.zmq:
            return False
        grams = _datagrams(frames, link.id, vouch)
        with link.lock:
            if link.zmq:
                return False
            if link.pending or link.sock is None:
                self._wait_for_room(link, len(grams), block)
                link.pending.extend(grams)
                return True
            sock = link.sock
            assert sock is not None
            for i, g in enumerate(grams):
                try:
                    sock.sendmsg(g)
                except BlockingIOError:
                    link.pending.extend(grams[i:])
                    self._watch(link)
                    return True
                except _REFUSED:
                    # Nothing listens there any more: the peer is gone, and ZeroMQ queues for
                    # it, as it always did for a peer that is gone.
                    link.zmq = True
                    return i > 0  # the first pieces went: the rest would be of no use
        return True

    def _wait_for_room(self, link: Link, n: int, block: bool) -> None:
        """(Holding the link's lock.) Until ``n`` more datagrams fit in its queue."""
        if len(link.pending) + n <= self.queue_limit:
            return
        if block and not self.io.is_current():
            deadline = time.monotonic() + self.block_s
            while len(link.pending) + n > self.queue_limit and not link.zmq:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                link.room.wait(min(left, 0.1))
            else:
                return
        raise SendFailed(
            f"cannot send to {link.address}: {len(link.pending)} messages are already queued for it and it has "
            f"read none for {self.block_s if block else 0:g} s; the process there is not reading (stopped with "
            f"SIGSTOP, stuck, or overloaded); see %mesh status, or raise MONARCH_KERNEL_SEND_QUEUE")

    def _retry(self, link: Link, delay: float) -> None:
        """On the IO thread: connect a link whose inbox was not there, and send what waits;
        else try again a little later (until the link is closed: its peer is gone)."""
        with link.lock:
            if link.zmq or link.sock is not None:
                return
            if self.gone(link.address, link.epoch):  # (its thread may have ended without dropping it)
                link.zmq = True
                link.pending.clear()
                link.room.notify_all()
                return
            if not link.connect():
                later = min(2 * delay, RETRY_MAX_S)
                self.io.loop.call_later(delay, self._retry, link, later)
                return
            if link.pending:
                self._watch(link)

    def _watch(self, link: Link) -> None:
        """(Holding the link's lock.) Have the IO thread send what is pending as room comes."""
        if link.watching or link.sock is None:
            return
        link.watching = True
        fd = link.sock.fileno()
        self.io.call_soon(self.io.loop.add_writer, fd, self._flush, link, fd)

    def _flush(self, link: Link, fd: int) -> None:
        """On the IO thread, when the peer has room: send what waits, in order."""
        with link.lock:
            sock, pending = link.sock, link.pending
            try:
                while pending and sock is not None:
                    sock.sendmsg(pending[0])
                    pending.popleft()
            except BlockingIOError:
                pass
            except OSError as e:  # the peer went away meanwhile (refused): nobody will read these
                if not isinstance(e, _REFUSED):
                    log.warning("monarch_kernel: %d messages for %s were dropped: %s", len(pending), link.address, e)
                pending.clear()
                link.zmq = True
            if not pending or sock is None:
                link.watching = False
                self.io.loop.remove_writer(fd)
                if link.zmq and sock is not None:
                    sock.close()
                    link.sock = None
            link.room.notify_all()

    def forget(self, prefixes: list[str]) -> None:
        """This thread drops its links to inboxes under ``prefixes`` (their peers are gone)."""
        links = self._links()
        for prefix in prefixes:
            for addr in [a for a in links if a == prefix or a.startswith(prefix + ".")]:
                links.pop(addr).close()
