"""The framing between a controller and its template: one ``host_messages`` message per datagram
of a ``SOCK_SEQPACKET`` socketpair, with file descriptors passed alongside (``SCM_RIGHTS``).
Both processes import it (``template_client`` in the controller, ``template/server.py`` in the
template); it holds framing (and the template's outbox, a send queue), never either side's
state: which ranks exist, what they print.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import os
import socket

from ..wire import rejects
from .host_messages import MalformedMessage, Message, decode

MAX_MSG = 1 << 20  # a launch config is a few KiB (sys.path and env are its largest parts); output ~48 KiB
_MAX_FDS = 16
# A rank's hello travels on inside one ``Hello`` datagram, which must fit the socket's send
# buffer whole (net.core.wmem_default, about 200 KiB, where wmem_max allows no more).
MAX_CONTROL = 160 << 10


def send_msg(sock: socket.socket, msg: Message, fds=()) -> None:
    """Send ``msg`` as one datagram, passing ``fds`` with it (the caller still owns them)."""
    data = msg.encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


class Outbox:
    """(the template's) Messages for the controller, sent without ever blocking the template: what the
    socket cannot take now waits here, and while too much waits the ranks' output is not
    read (so ranks that print faster than the controller reads wait on their pipes)."""

    LIMIT = 8 << 20

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.queue: collections.deque = collections.deque()
        self.bytes = 0
        # A datagram must fit the socket's send buffer whole; ask for room for the largest
        # (the kernel caps this at net.core.wmem_max, often ~200 KiB).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MSG)

    def send(self, msg: Message) -> None:
        data = msg.encode()
        if not self.queue:
            try:
                self.sock.send(data)
                return
            except BlockingIOError:
                pass
            except OSError as e:
                self._refused(msg.OP, data, e)
                return
        self.queue.append(data)
        self.bytes += len(data)

    def flush(self) -> None:
        while self.queue:
            try:
                self.sock.send(self.queue[0])
            except BlockingIOError:
                return
            except OSError as e:
                self._refused("queued", self.queue[0], e)
            self.bytes -= len(self.queue.popleft())

    @staticmethod
    def _refused(op: str, data: bytes, e: OSError) -> None:
        """A message the socket will never take (over its datagram limit): count it, go on."""
        if e.errno != errno.EMSGSIZE:
            raise e
        rejects.count("template", "oversized", f"a {op!r} message of {len(data)} bytes is larger than the "
                      "template's socket takes in one datagram; it was dropped")

    @property
    def full(self) -> bool:
        return self.bytes > self.LIMIT


def recv_msg(sock: socket.socket, flags: int = 0) -> tuple[Message | None, list[int]]:
    """One message and the fds that came with it (now ours to close); ``None`` at EOF.
    ``flags=socket.MSG_DONTWAIT``: raise BlockingIOError when none is waiting.  A datagram
    that is no message raises ``MalformedMessage`` (its fds closed)."""
    data, ancdata, _flags, _addr = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(_MAX_FDS * 4), flags)
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - (len(cdata) % a.itemsize)])
            fds.extend(a)
    if not data:
        return None, fds
    try:
        return decode(data), fds
    except MalformedMessage as e:
        for f in fds:
            os.close(f)
        rejects.count("template", "malformed", str(e))
        raise


class ControlReader:
    """Cuts what a rank writes on its control pipe into frames (``[4-byte big-endian length]
    [frame]``; an empty frame is a beat).  A frame over ``MAX_CONTROL`` is counted and the
    pipe is read no further (nothing after it can be trusted to be a frame boundary)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.broken = False

    def feed(self, data: bytes) -> list[bytes]:
        """The whole frames ``data`` completes, in order (``b""`` for a beat)."""
        if self.broken:
            return []
        buf = self._buf
        buf.extend(data)
        out: list[bytes] = []
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if n > MAX_CONTROL:
                self.broken = True
                buf.clear()
                rejects.count("template", "oversized", f"a rank's control frame of {n} bytes is over {MAX_CONTROL}")
                return out
            if len(buf) < 4 + n:
                break
            out.append(bytes(buf[4:4 + n]))
            del buf[:4 + n]
        return out

