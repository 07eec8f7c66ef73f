"""The framing between a controller and its template: one ``host_wire`` message per datagram
of a ``SOCK_SEQPACKET`` socketpair, with file descriptors passed alongside (``SCM_RIGHTS``).
Both processes import it (``template_client`` in the controller, ``template_server`` in the
template); it holds framing only, never either side's state.
"""

from __future__ import annotations

import array
import os
import socket

from .host_wire import MalformedMessage, Message, decode

MAX_MSG = 1 << 20  # a launch config is a few KiB (sys.path and env are its largest parts); output ~48 KiB
_MAX_FDS = 16


def send_msg(sock: socket.socket, msg: Message, fds=()) -> None:
    """Send ``msg`` as one datagram, passing ``fds`` with it (the caller still owns them)."""
    data = msg.encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


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
    except MalformedMessage:
        for f in fds:
            os.close(f)
        raise
