"""Garbage on the kernel's own Jupyter ports: the kernel goes on, every rank line still
arrives, no traceback reaches a cell, and the frames are counted (and said in the
kernel's log in one line every 10 s)."""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import sys
import threading

import pytest
from jupyter_client.session import Session
from support.kernels import run

from monarch_kernel.kernel.port_guard import PortGuard

pytestmark = pytest.mark.timeout(180)
LINE = re.compile(r"^\[rank (\d+)\] L (\d+) (\d+) (\d+)$")


def _record_of(fn) -> logging.LogRecord:
    try:
        fn()
    except Exception:
        return logging.LogRecord("tornado.general", logging.ERROR, __file__, 1,
                                 "Uncaught exception in ZMQStream callback", (), sys.exc_info())
    raise AssertionError("it did not raise")


def test_the_guard_counts_malformed_frames_and_speaks_once_per_interval():
    guard = PortGuard(every=3600)
    garbage = _record_of(lambda: Session(key=b"k").feed_identities([b"\x07garbage", b"more"], copy=True))
    assert guard.filter(garbage) and garbage.levelno == logging.WARNING and garbage.exc_info is None
    text = garbage.getMessage()
    assert "dropped 1 malformed frame(s) on this kernel's Jupyter ports (no identity delimiter" in text, text
    for _ in range(5):  # within the interval: counted, not said
        assert not guard.filter(_record_of(lambda: Session(key=b"k").feed_identities([b"x"], copy=True)))
    assert guard.counts == {"no identity delimiter: not a Jupyter message": 6}
    other = _record_of(lambda: 1 / 0)  # any other error is left as it is, traceback and all
    assert guard.filter(other) and other.exc_info is not None and other.levelno == logging.ERROR


def _blast(ports: list[int], stop: threading.Event, sent: list[int]) -> None:
    """Connect to each port, send random bytes of random sizes, hang up; until ``stop``."""
    rng = random.Random(5)
    while not stop.is_set():
        for port in ports:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(os.urandom(rng.choice((1, 10, 64, 1000, 70000))))
                    sent[0] += 1
            except OSError:
                pass
        stop.wait(0.02)


def test_garbage_on_the_jupyter_ports_loses_no_line_and_shows_no_traceback(kc):
    assert run(kc, "procs = %mesh spawn -n 2", timeout=120).reply["status"] == "ok"
    # The five channels, and ipykernel's IOPub pipe for forked subprocesses' output.
    pipe = run(kc, "print(get_ipython().kernel.iopub_thread._pipe_port)").text
    ports = [kc.shell_port, kc.control_port, kc.iopub_port, kc.stdin_port, kc.hb_port, int(pipe)]
    stop, sent = threading.Event(), [0]
    blaster = threading.Thread(target=_blast, args=(ports, stop, sent), daemon=True)
    blaster.start()
    stderr: list[str] = []
    try:
        for k in range(6):
            code = ("%%mesh\nimport time\nfrom monarch_kernel import current_rank\n_r = current_rank().rank\n"
                    f"for _i in range(20):\n    print(f'L {k} {{_r}} {{_i}}', flush=True)\n    time.sleep(0.02)\n")
            outputs, reply = run(kc, code, timeout=60)
            assert reply["status"] == "ok", outputs
            stdout = "".join(o.text for o in outputs if o.name == "stdout")
            got = sorted((int(m[1]), int(m[4])) for line in stdout.splitlines()
                         if (m := LINE.match(line)) and int(m[2]) == k)
            assert got == [(r, i) for r in range(2) for i in range(20)], stdout
            stderr += [o.text for o in outputs if o.name == "stderr"]
    finally:
        stop.set()
        blaster.join(10)
    assert sent[0] > 50, sent
    said = "".join(stderr)
    assert "Traceback" not in said and "DELIM" not in said and "Bad pipe" not in said, said[:2000]
    # Counted in the kernel, and said in its log (once every 10 s), not in the cells.
    counts = run(kc, "print(dict(get_ipython().kernel.port_guard.counts))").text
    assert re.search(r"'no identity delimiter: not a Jupyter message': \d{2,}", counts), counts
    assert re.search(r"'a message on the IOPub pipe without its key': \d{2,}", counts), counts
    # A forked subprocess's output still arrives through the pipe.
    forked = run(kc, "import multiprocessing as mp\n"
                     "p = mp.get_context('fork').Process(target=print, args=('from a fork',))\n"
                     "p.start(); p.join()", timeout=60).text
    assert "from a fork" in forked, forked
    assert run(kc, "1 + 1").outputs[-1].text == "2"  # and the kernel still answers
