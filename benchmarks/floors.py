"""Hardware floors on the same machine, for reading the runtime's numbers: raw pyzmq
DEALER/ROUTER round trip between two processes over ipc (16 B, 2000 after warm-up; W2's
floor), the same to 4 peers at once and all answers back (500; W3's floor), and a
64 MiB zero-copy send over the same socket (the runtime's own transport), a warm numpy copy
of 64 MiB, and 64 MiB over loopback TCP (sendall/recv_into).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from ._util import kill_group, log, summary_us, time_calls

NBYTES = 64 << 20

_ZMQ_ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
print("bound", flush=True)
while True:
    ident, msg = s.recv_multipart(copy=False)
    small = msg.buffer.nbytes < 1024
    s.send_multipart([ident, msg.bytes if small else b"k"])  # big messages: a 1-byte ack
    if small and msg.bytes == b"stop":
        break
s.close(linger=1000)
ctx.term()
"""

_TCP_SINK = """
import socket, sys
n, runs, sockbuf = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ls = socket.socket()
if sockbuf:
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
ls.bind(("127.0.0.1", 0))
ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
buf = bytearray(n)
view = memoryview(buf)
for _ in range(runs):
    got = 0
    while got < n:
        k = c.recv_into(view[got:], n - got)
        if not k:
            sys.exit(1)
        got += k
    c.sendall(b"k")
c.close()
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


@contextlib.contextmanager
def echo_peer():
    """A raw pyzmq echo process over ipc and a DEALER connected to it: ``(process, socket)``;
    the echo is told to stop, and ended, on the way out."""
    import zmq

    tmp = tempfile.mkdtemp(prefix="mkbench-zmq-")
    addr = f"ipc://{tmp}/echo"
    p = _child(_ZMQ_ECHO, addr)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        p.stdout.readline()
        s.connect(addr)
        yield p, s
        s.send(b"stop")
        s.recv()
        p.wait(timeout=10)
    finally:
        s.close(linger=0)
        ctx.term()
        if p.poll() is None:
            kill_group(p)
        shutil.rmtree(tmp, ignore_errors=True)


def pyzmq_rtt() -> dict:
    with echo_peer() as (_p, s):
        msg = b"x" * 16

        def rtt(_i):
            s.send(msg)
            s.recv()

        samples = time_calls(rtt, 200, 2000)
        big = memoryview(bytearray(b"\1" * NBYTES))

        def bulk(_i):
            s.send(big, copy=False)
            s.recv()

        bulk_s = statistics.median(time_calls(bulk, 2, 8))
    return summary_us(samples), round(NBYTES / 1e6 / bulk_s, 1)


def pyzmq_rtt_peers(n: int = 4) -> dict:
    """W3's floor: one 16-byte message to each of ``n`` echo processes over ipc (a DEALER
    per peer, as the runtime has a socket per peer) and all ``n`` answers back."""
    import zmq

    tmp = tempfile.mkdtemp(prefix="mkbench-zmq-")
    addrs = [f"ipc://{tmp}/echo{i}" for i in range(n)]
    procs = [_child(_ZMQ_ECHO, a) for a in addrs]
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in addrs]
    try:
        for p, s, a in zip(procs, socks, addrs, strict=True):
            p.stdout.readline()
            s.connect(a)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        msg = b"x" * 16

        def rtt(_i):
            for s in socks:
                s.send(msg)
            left = n
            while left:
                for s, _ev in poller.poll():
                    s.recv()
                    left -= 1

        samples = time_calls(rtt, 100, 500)
        for s in socks:
            s.send(b"stop")
            s.recv()
        for p in procs:
            p.wait(timeout=10)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        for p in procs:
            if p.poll() is None:
                kill_group(p)
        shutil.rmtree(tmp, ignore_errors=True)
    return summary_us(samples)


def memcpy() -> float:
    import numpy as np

    src = np.ones(NBYTES, dtype=np.uint8)
    dst = np.zeros(NBYTES, dtype=np.uint8)  # touched: no page faults in the timed copies

    def copy(_i):
        np.copyto(dst, src)

    return round(NBYTES / 1e6 / statistics.median(time_calls(copy, 2, 10)), 1)


def tcp_loopback(runs: int = 8, warmup: int = 2, sockbuf: int = 0) -> float:
    """64 MiB ``sendall``/``recv_into`` over loopback; ``sockbuf``: socket buffer sizes
    (0: the kernel's defaults)."""
    p = _child(_TCP_SINK, str(NBYTES), str(runs + warmup), str(sockbuf))
    c = None
    try:
        port = int(p.stdout.readline())
        c = socket.socket()
        if sockbuf:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        c.connect(("127.0.0.1", port))
        data = memoryview(bytearray(b"\1" * NBYTES))

        def send(_i):
            c.sendall(data)
            assert c.recv(1) == b"k"

        samples = time_calls(send, warmup, runs)
        p.wait(timeout=10)
    finally:
        if c is not None:
            c.close()
        if p.poll() is None:
            kill_group(p)
    return round(NBYTES / 1e6 / statistics.median(samples), 1)


def floors() -> dict:
    t = time.perf_counter()
    rtt, ipc_bulk = pyzmq_rtt()
    out = {"floor_pyzmq_rtt_us": rtt,
           "floor_pyzmq_rtt_4_peers_us": pyzmq_rtt_peers(4),
           "floor_pyzmq_ipc_64MiB_MBps": ipc_bulk,
           "floor_memcpy_64MiB_MBps": memcpy(),
           "floor_tcp_loopback_64MiB_MBps": tcp_loopback()}
    log(f"floors ({time.perf_counter() - t:.1f} s): {out}")
    return out
