"""Which host a process is on, and the addresses other hosts can reach it at.

Two processes share a host when they share a kernel (boot id) and a network namespace:
separate namespaces are how containers and simulated hosts are kept apart, and they may not
share ``/dev/shm`` either, so such pairs talk over TCP.  A data server listens only where its
peers can be: loopback while every rank is on this host, never every interface by default.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import ipaddress
import os
import re
import socket
import struct

from .. import config

SIOCGIFADDR = 0x8915
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?$")


def check_name(host, what: str, example: str) -> str:
    """``host`` if it is a host name (at most 253 characters, labels of at most 63 letters,
    digits, ``-`` or ``_``) or an IP address without a zone; else a ValueError (a TypeError
    for what is not a string) that names ``what`` and shows ``example``, said before any
    lookup (the resolver's own errors for such names say nothing of where they came from)."""
    if not isinstance(host, str):
        raise TypeError(f"{what}: a host is a name or an address, e.g. {example}; not {type(host).__name__} "
                        f"{host!r:.60}")
    shown = host if len(host) <= 60 else f"{host[:40]}... ({len(host):,} characters)"
    try:
        ipaddress.ip_address(host)
        if "%" not in host:
            return host
    except ValueError:
        labels = host.split(".")
        if 0 < len(host) <= 253 and all(len(x) <= 63 and _LABEL.match(x) for x in labels):
            return host
    raise ValueError(f"{what}: {shown!r} is not a host name or address (a name is at most 253 characters of "
                     f"letters, digits, '-' and '.', at most 63 between dots; an address has no %zone); e.g. "
                     f"{example}")


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
    found: list[str] = []
    loop: list[str] = []
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


def job_spans_hosts() -> bool:
    """Whether peers of this process may be on other hosts: it was started on a job's host
    (its agent set MONARCH_KERNEL_BIND), or placed in a network namespace (MONARCH_KERNEL_NETNS)."""
    return config.bind_address() is not None or config.netns() is not None


def data_listen_addresses() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(bind, advertise)``: the addresses a data server listens on for TCP peers, and
    those it tells them to connect to, best first.

    MONARCH_KERNEL_DATA_BIND when given; else MONARCH_KERNEL_BIND (a job's host); else loopback
    when every rank is on this host; else this namespace's interface addresses (the ones a
    veth, or a NIC, reaches peers through).
    """
    given = config.data_bind_address()
    if given:
        bind = tuple(a.strip() for a in given.split(",") if a.strip())
        if "0.0.0.0" in bind:
            return ("0.0.0.0",), ipv4_addresses()
        return bind, bind
    if (ip := config.bind_address()) is not None:
        return (ip,), (ip,)
    if job_spans_hosts():
        found = tuple(a for a in ipv4_addresses() if not a.startswith("127."))
        if found:
            return found, found
    return ("127.0.0.1",), ("127.0.0.1",)


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
