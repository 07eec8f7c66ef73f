"""Which host a process is on, and the addresses other hosts can reach it at.

Two processes share a host when they share a kernel (boot id) and a network namespace:
separate namespaces are how containers and simulated hosts are kept apart, and they may not
share ``/dev/shm`` either, so such pairs talk over TCP.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import socket
import struct

SIOCGIFADDR = 0x8915


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


def ipv4_addresses() -> tuple[str, ...]:
    """This network namespace's IPv4 addresses, loopback last."""
    found, loop = [], []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on this interface
            addr = socket.inet_ntoa(res[20:24])
            (loop if addr.startswith("127.") else found).append(addr)
    finally:
        s.close()
    return tuple(found + (loop or ["127.0.0.1"]))


def enter_netns(spec: str) -> None:
    """Move this (single-threaded) process into a network namespace."""
    path = spec if "/" in spec else f"/run/netns/{spec}"
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {path}: {os.strerror(err)} "
                               "(needs CAP_SYS_ADMIN)")
    finally:
        os.close(fd)
    host_key.cache_clear()
