"""What ssh itself makes of a host name: ``ssh -G`` applies the user's configuration (a
``Host`` alias, ``HostName``, ``ProxyJump``; ``-F FILE`` and ``-J`` in ``ssh_args``), so a
name only ssh knows is resolved the way ssh will resolve it.  Nothing here connects.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class SSHTarget:
    """``alias``: the name the job was given; ``hostname``: where ssh connects to (or, through
    ``jumps``, where the last jump host connects to); ``jumps``: the ProxyJump hops, in order."""

    alias: str
    hostname: str
    jumps: tuple[str, ...] = ()


def ssh_target(host: str, ssh_args=()) -> SSHTarget:
    """``host`` as ssh's configuration and ``ssh_args`` resolve it (``ssh -G``)."""
    try:
        r = subprocess.run(["ssh", "-G", *ssh_args, host], capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise FileNotFoundError("ssh is not installed on this machine: SSHJob runs the ssh client") from None
    if r.returncode != 0:
        said = r.stderr.strip().splitlines()
        raise ValueError(f"ssh cannot read its configuration for {host!r} with ssh_args {list(ssh_args)}"
                         + (f": {said[-1]}" if said else ""))
    seen: dict[str, str] = {}
    for line in r.stdout.splitlines():
        key, _, value = line.partition(" ")
        seen.setdefault(key.lower(), value.strip())
    jump = seen.get("proxyjump", "none")
    jumps = () if jump in ("", "none") else tuple(j for j in jump.split(",") if j)
    return SSHTarget(host, seen.get("hostname") or host, jumps)


def jump_host(jump: str) -> str:
    """The host of a ProxyJump hop (``user@host:port``, ``ssh://user@[v6]:port``)."""
    jump = jump.removeprefix("ssh://").rsplit("@", 1)[-1]
    if jump.startswith("["):
        return jump[1:].split("]", 1)[0]
    return jump.rsplit(":", 1)[0] if jump.count(":") == 1 else jump


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, 22, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror:
        return False
    return True


def route_host(host: str, ssh_args=()) -> str:
    """The name or address this machine routes toward to reach ``host``: ssh's HostName for
    it, or, when only its jump host can resolve that, the first jump host's own HostName."""
    target = ssh_target(host, ssh_args)
    if _resolves(target.hostname):
        return target.hostname
    if target.jumps:
        first = ssh_target(jump_host(target.jumps[0]), ssh_args)
        if _resolves(first.hostname):
            return first.hostname
    via = f" (through {', '.join(target.jumps)})" if target.jumps else ""
    raise ConnectionError(
        f"cannot resolve host {host!r}: ssh's configuration names it {target.hostname!r}{via}, which this "
        "machine cannot resolve; give its address, or a Host entry with HostName in ~/.ssh/config "
        "(or ssh_args=('-F', FILE))")
