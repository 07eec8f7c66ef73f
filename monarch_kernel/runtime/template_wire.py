"""The wire between a controller and its template: msgpack dicts, one per datagram of a
``SOCK_SEQPACKET`` socketpair, with file descriptors passed alongside (``SCM_RIGHTS``).
Both processes import it (``template_client`` in the controller, ``template_server`` in the
template); it holds framing and op names only, never either side's state.
"""

from __future__ import annotations

import array
import socket

import msgpack

# Every message is a dict with an "op" key.
FORK = "fork"  # controller -> template: {tag, config: LaunchConfig.to_wire()}
KILL = "kill"  # controller -> template: {pid, signal}
READY = "ready"  # template -> controller, first: {nofile} (its open-files limit)
FORKED = "forked"  # template -> controller: {tag, pid}
FORK_FAILED = "fork_failed"  # template -> controller: {tag, error} (a limit was reached; the error says which)
OUTPUT = "output"  # template -> controller: {items: [[pid, fd (1 or 2), bytes], ...]}, in the order read
HELLO = "hello"  # template -> controller: {pid, hello}: the rank is up (hello: its msgpack'd hello frame)
BEATS = "beats"  # template -> controller, each second: {pids} that beat since the last
EXIT = "exit"  # template -> controller: {pid, status} once reaped (status as os.waitpid gives it)

MAX_MSG = 1 << 20  # a launch config is a few KiB (sys.path and env are its largest parts); output ~48 KiB
_MAX_FDS = 16


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def send_msg(sock: socket.socket, msg: dict, fds=()) -> None:
    """Send ``msg`` as one datagram, passing ``fds`` with it (the caller still owns them)."""
    data = msgpack.packb(msg, use_bin_type=True)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, flags: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the fds that came with it (now ours to close); ``None`` at EOF.
    ``flags=socket.MSG_DONTWAIT``: raise BlockingIOError when none is waiting."""
    data, ancdata, _flags, _addr = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(_MAX_FDS * 4), flags)
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - (len(cdata) % a.itemsize)])
            fds.extend(a)
    if not data:
        return None, fds
    return msgpack.unpackb(data, raw=False), fds
