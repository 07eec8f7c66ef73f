"""Fixtures of the runtime's own tests."""

from __future__ import annotations

import os

import pytest
import zmq

from monarch_kernel.runtime.net.io_thread import IOThread
from monarch_kernel.runtime.net.network import Network
from monarch_kernel.runtime.wire.auth import DropCounts, Signer


@pytest.fixture
def network(tmp_path):
    """A ``Network`` of its own (not this process's runtime's), its main inbox at
    ``ipc://TMP/main`` and no TCP yet; closed with its IO thread and context after the test."""
    ctx = zmq.Context()
    io = IOThread(name="test-network")
    net = Network(ctx, io, DropCounts(), None, vouched=Signer(os.urandom(32)).vouched)
    net.main_inbox(f"ipc://{tmp_path}/main")
    try:
        yield net
    finally:
        io.loop.call_soon_threadsafe(io.loop.stop)
        io.thread.join(10)
        io.loop.close()
        if net.main is not None:
            net.main.close()
        ctx.destroy(linger=0)
