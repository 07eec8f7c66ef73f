"""The streaming transport: the bytes themselves travel over the data connection (TCP across
hosts; the Unix socket on one host when memory cannot be mapped), owner half and reader half.
It must never hash or stage CPU bytes: they go straight between memory and the socket.
"""

from __future__ import annotations

import socket
import threading

from . import client, wire
from .memory import Memory

STREAM_MIN = 8 << 20  # below this, one connection is as fast as several


# ---------------------------------------------------------------- owner side


def serve_read(sock: socket.socket, mem: Memory, offset: int, nbytes: int) -> None:
    """Answer a checked ``READ``: OK, then the bytes."""
    wire.send_reply(sock, wire.Status.OK)
    if nbytes:
        if mem.device == "cpu":
            sock.sendall(mem.view[offset:offset + nbytes])
        else:
            sock.sendall(_cuda_to_host(mem, offset, nbytes))


def serve_write(sock: socket.socket, mem: Memory, offset: int, nbytes: int) -> None:
    """Answer a checked ``WRITE``: OK, take the bytes, OK once they are in place."""
    wire.send_reply(sock, wire.Status.OK)
    if nbytes:
        if mem.device == "cpu":
            wire.recv_into_all(sock, mem.view[offset:offset + nbytes])
        else:
            staging = bytearray(nbytes)
            wire.recv_into_all(sock, memoryview(staging))
            _host_to_cuda(mem, offset, staging)
    wire.send_reply(sock, wire.Status.OK)


def _cuda_bytes(mem: Memory):
    import torch

    return mem.tensor.detach().reshape(-1).view(torch.uint8)


def _cuda_to_host(mem: Memory, offset: int, nbytes: int) -> memoryview:
    host = _cuda_bytes(mem)[offset:offset + nbytes].cpu()
    return memoryview(host.numpy())


def _host_to_cuda(mem: Memory, offset: int, data: bytearray) -> None:
    import torch

    src = torch.frombuffer(data, dtype=torch.uint8)
    _cuda_bytes(mem)[offset:offset + len(data)].copy_(src)


# ---------------------------------------------------------------- reader side


def stream(h, key: bytes, via: str, op: wire.Op, view: memoryview, offset: int, timeout: float | None) -> None:
    """One ``READ`` into ``view`` or ``WRITE`` from it over one connection."""
    def run():
        with client.Connection(h, via, key, timeout) as sock:
            client.request(sock, h, op, offset, view.nbytes)
            if op == wire.Op.READ:
                wire.recv_into_all(sock, view)
            else:
                sock.sendall(view)
                done = wire.recv_reply(sock)
                client.raise_for(h, done.status, done.message)

    client.guarded(h, run)


def transfer(h, key: bytes, op: wire.Op, view: memoryview, offset: int, timeout: float | None,
             streams: int) -> None:
    """Split a large TCP transfer over ``streams`` connections, one thread each."""
    n = view.nbytes
    if streams <= 1 or n < STREAM_MIN:
        stream(h, key, "tcp", op, view, offset, timeout)
        return
    step = -(-n // streams)
    errors: list[BaseException] = []

    def part(start: int) -> None:
        try:
            stream(h, key, "tcp", op, view[start:start + step], offset + start, timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=part, args=(s,), daemon=True) for s in range(step, n, step)]
    for t in threads:
        t.start()
    part(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
