"""Who is at the other end of a loopback TCP connection: the user owning the peer's socket,
as Linux lists it in /proc/net/tcp and /proc/net/tcp6 (identd answers the same question the
same way).  The debugger's TCP ports take a connection only from the debuggee's own user.

Runs in debugpy's adapter (``debug_adapter.py``), a rank's or the kernel's.  It must fail closed: a peer it cannot
find in this network namespace (another host, another namespace), or finds only as a socket
no process holds any more (the kernel lists those as uid 0), belongs to nobody.
"""

from __future__ import annotations

import os
import socket
import struct

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _address(ip: str) -> bytes:
    """``ip`` as 16 bytes (an IPv4 address as IPv4-mapped IPv6, as a dual-stack socket sees it)."""
    if ":" in ip:
        return socket.inet_pton(socket.AF_INET6, ip.split("%", 1)[0])
    return _V4_MAPPED + socket.inet_aton(ip)


def _listed(hex_address: str) -> bytes:
    """An address as /proc/net/tcp{,6} prints it (32-bit words, each in host byte order)."""
    raw = b"".join(struct.pack("=I", int(hex_address[i:i + 8], 16)) for i in range(0, len(hex_address), 8))
    return raw if len(raw) == 16 else _V4_MAPPED + raw


def owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid of the socket bound at ``local`` and connected to ``remote`` in this network
    namespace, or None when there is no such socket held by a process."""
    want_local, want_remote = (_address(local[0]), local[1]), (_address(remote[0]), remote[1])
    port_suffix = f":{local[1]:04X}"
    uids = set()
    for table in TABLES:
        try:
            f = open(table, encoding="ascii")
        except OSError:
            continue  # no IPv6 on this host (or the table is hidden: then nobody is found)
        with f:
            next(f, None)  # the header line
            for line in f:
                fields = line.split()
                if len(fields) < 10 or not fields[1].endswith(port_suffix):
                    continue
                (l_ip, l_port), (r_ip, r_port) = (a.rsplit(":", 1) for a in fields[1:3])
                if ((_listed(l_ip), int(l_port, 16)) == want_local and (_listed(r_ip), int(r_port, 16)) == want_remote
                        and fields[9] != "0"):  # inode 0: a closed socket in TIME_WAIT, listed as uid 0
                    uids.add(int(fields[7]))
    return uids.pop() if len(uids) == 1 else None


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the other end of ``conn`` (an accepted TCP connection), if it is on this
    host's loopback in this network namespace and still open."""
    try:
        return owner(conn.getpeername()[:2], conn.getsockname()[:2])
    except OSError:  # the peer has gone already
        return None


def from_this_user(conn: socket.socket) -> bool:
    """Whether the other end of ``conn`` is a socket of this process's own user."""
    return peer_uid(conn) == os.geteuid()
