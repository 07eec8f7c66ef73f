"""Bytes from outside, over real sockets, to a real rank: a 1 GiB unsigned frame on the
rank's ipc inbox is refused by ZeroMQ before it is buffered (``MONARCH_KERNEL_MAX_WIRE_FRAME``,
ZMQ_MAXMSGSIZE) while legitimate values larger than that still pass, in pieces; garbage on
the rank's data server, before and after the handshake, is refused and counted.  The rank
stays up and answers after each."""

from __future__ import annotations

import logging
import mmap
import os
import random
import socket

import psutil
import pytest
import zmq
from support.actors import Echo, wait_for

from monarch_kernel import Actor, ActorError, RDMABuffer, endpoint, this_host
from monarch_kernel.data import wire
from monarch_kernel.runtime import config
from monarch_kernel.runtime.process import Runtime
from monarch_kernel.runtime.wire import framing

GIB = 1 << 30


PATTERN = bytes(range(256)) * 16


class Owner(Actor):
    def __init__(self):
        self.kept = []

    @endpoint
    def array(self, n: int):
        import numpy as np

        a = np.full(n, 7, dtype=np.uint8)
        a[-1] = n % 251
        return a

    @endpoint
    def make(self) -> RDMABuffer:
        b = bytearray(PATTERN)
        self.kept.append(b)
        return RDMABuffer(b)


@pytest.fixture(scope="module")
def mesh():
    """One rank: its inbox and its data server are what the tests aim at."""
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        yield procs, procs.spawn("echo", Echo), procs.spawn("owner", Owner)


def rejected(echo) -> dict:
    return echo.stats.call_one().get(timeout=30)["rejected"]


@pytest.mark.timeout(90)
def test_a_gib_frame_on_a_ranks_ipc_inbox_is_refused_before_it_is_buffered(mesh):
    procs, echo, _owner = mesh
    assert config.max_wire_frame() == framing.CHUNK < GIB
    rank = psutil.Process(echo.pid.call_one().get(timeout=30))
    rss_before = rank.memory_info().rss
    dropped_before = rejected(echo).get("zmq/disconnected", 0)

    ctx = zmq.Context()
    frame = mmap.mmap(-1, GIB)  # untouched pages: sending it costs this process no memory
    try:
        s = ctx.socket(zmq.PUSH)
        s.connect(procs._ref.addresses[0])  # the rank's main inbox, as any local process could
        s.send(frame, copy=False)
        # ZeroMQ reads the frame's length, refuses it and ends the connection.
        assert wait_for(lambda: rejected(echo).get("zmq/disconnected", 0) > dropped_before, timeout=30), \
            "the rank never counted the refused connection"
        s.close(linger=0)
    finally:
        ctx.term()
        del frame
    grew = rank.memory_info().rss - rss_before
    assert grew < GIB // 4, f"the rank's memory grew by {grew >> 20} MiB while refusing a 1 GiB frame"
    assert echo.echo.call_one("after").get(timeout=30) == "after"


@pytest.mark.timeout(90)
def test_values_larger_than_the_wire_frame_limit_still_pass_in_pieces(mesh):
    """A rank's reply of an array over the limit, and of exactly the piece size, arrives
    whole (out of band: the array's bytes are one frame of their own)."""
    _procs, _echo, owner = mesh
    for n in (framing.CHUNK + 8, framing.CHUNK):
        a = owner.array.call_one(n).get(timeout=60)
        assert a.nbytes == n and a[0] == 7 and a[-1] == n % 251
        del a


@pytest.mark.timeout(60)
def test_garbage_on_a_ranks_data_server_is_refused_and_counted(mesh):
    _procs, echo, owner = mesh
    buf = owner.make.call_one().get(timeout=30)
    h = buf._h
    before = rejected(echo)
    key = Runtime.current().key

    # Garbage where the client's half of the handshake goes.
    with socket.create_connection((h.addresses[0], h.port), timeout=10) as s:
        assert s.recv(len(wire.MAGIC)) == wire.MAGIC
        s.sendall(os.urandom(wire.NONCE + wire.MAC))
        assert _closed(s)
    # With the key, a request whose blob claims 4 GiB: refused before anything is buffered.
    with socket.create_connection((h.addresses[0], h.port), timeout=10) as s:
        wire.client_handshake(s, key)
        s.sendall(wire.Request(wire.Op.IB_CONNECT, h.id, h.token, 0, 0).encode() + wire.LENGTH.pack(0xFFFFFFFF))
        assert _closed(s)
    # With the key, requests of random bytes: each answered with a status, never a crash.
    rng = random.Random(22)
    with socket.create_connection((h.addresses[0], h.port), timeout=10) as s:
        wire.client_handshake(s, key)
        for _ in range(50):
            raw = bytearray(rng.randbytes(wire.REQUEST.size))
            raw[0] = rng.choice([wire.Op.CHECK, 0, 9, 200])  # never READ/WRITE/MAP: they would move bytes
            s.sendall(bytes(raw))
            reply = wire.recv_reply(s)
            assert reply.status != wire.Status.OK or raw[0] == wire.Op.CHECK

    def counted():
        now = rejected(echo)
        return (now.get("data/handshake", 0) > before.get("data/handshake", 0)
                and now.get("data/oversized", 0) > before.get("data/oversized", 0))

    assert wait_for(counted, timeout=30), rejected(echo)
    dst = bytearray(len(PATTERN))
    buf.read_into(dst).get(timeout=30)
    assert dst == PATTERN


@pytest.mark.timeout(60)
def test_a_refused_tcp_connection_is_logged_under_the_tcp_address(network, caplog):
    """A process's main inbox listens at its ipc address and, once it has hosts, at a TCP
    one: a connection refused on the TCP one is logged under that address, not the ipc one."""
    ipc = network.main.address
    tcp = network.listen("127.0.0.1")
    host, port = tcp[len("tcp://"):].rsplit(":", 1)
    caplog.set_level(logging.DEBUG, logger="monarch_kernel.rejects")

    def named(address: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if f"a connection to {address} " in r.getMessage()]

    def refused_and_logged() -> list[str]:
        # Not ZMTP, and no Curve key: the inbox ends the connection.  The log says a
        # reason's 1st, 2nd, 4th... time, so knock until one of ours is said.
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        return named(tcp)

    assert wait_for(refused_and_logged, timeout=30, interval=0.01), (
        f"no refusal was logged under {tcp}; under {ipc}: {named(ipc)[:3]}")
    assert named(ipc) == []


def huge_failure() -> None:
    raise ValueError("x" * (1 << 20))


@pytest.mark.timeout(60)
def test_a_bootstrap_error_too_large_for_the_control_pipe_still_fails_the_spawn():
    """The rank's hello (its bootstrap's error) must fit the template's control frame: a
    1 MiB error arrives cut short, and the spawn fails with it rather than waiting."""
    with pytest.raises(ActorError) as info:
        this_host().spawn_procs(per_host={"gpus": 1}, bootstrap=huge_failure, timeout=45)
    text = str(info.value)
    assert "ValueError: xxxx" in text and "is too large to report from a rank's bootstrap" in text


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF, or a reset), waiting up to its timeout."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True
