"""The rank's end of the DAP tunnel: ``DapRelay`` opens a connection to this rank's debugpy (a
socket pair whose other end the rank's debug adapter takes, ``rank_debugpy.open_client``) and
carries the kernel's DAP session over actor messages (the kernel's calls in, a port of the
kernel's out), so no debug port is reached over the network, or by anyone but the kernel.
``--listen``'s port is the kernel's (``controller/listen_gate.py``): its clients come through here too.

Runs in rank processes (the kernel spawns one per debugged rank, before debugpy starts).
All of it runs on the actor's own worker thread and event loop, which debugpy never traces
or suspends, so a rank stopped at a breakpoint still relays.  It must never wait on the
console or the IO thread, and never connect anywhere but this rank's own debugpy.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field

from ...actor.actor import Actor
from ...actor.endpoint import endpoint
from ...actor.port import Port
from ...runtime import SendFailed, config, hosts
from ..dap import FrameReader, encode
from ..messages import DapClosed, DapFrames, RankHost
from . import rank_debugpy

CONNECT_TIMEOUT_S = config.seconds("relay_connect_timeout")
READ_CHUNK = 1 << 16
# debugpy's adapter (1.8) sends every new client's arrival to the oldest session's client;
# if that one is still being torn down the send raises, and its accept thread dies, so the
# rank could never be debugged again.  So a session ends by half-closing and waiting for
# the adapter to close its side, and a new one connects SETTLE_S after the last one ended.
# The adapter also accepts a client on that same thread, sending it a few events as it does:
# a session ended before its last one (``debugpySockets``) has come kills the thread too, so
# ``open`` returns only once it has (or ACCEPT_WAIT_S has passed).
SETTLE_S = config.seconds("relay_settle")
END_WAIT_S = config.seconds("relay_end_wait")
ACCEPT_WAIT_S = config.seconds("relay_accept_wait")
ACCEPTED = "debugpySockets"  # the last event the adapter sends a client it is accepting


@dataclass
class _Link:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    port: Port  # the kernel's: every DapFrames and the final DapClosed go there
    loop: asyncio.AbstractEventLoop  # its relay's (the streams belong to it)
    lease_s: float  # the kernel renews within this, or the link ends
    heard: float = field(default_factory=time.monotonic)  # when the kernel last spoke on it
    why: str = ""  # set when this side ends it
    ended: threading.Event = field(default_factory=threading.Event)  # debugpy's side is closed too
    frames: FrameReader = field(default_factory=FrameReader)  # what was read of debugpy's stream
    early: list = field(default_factory=list)  # debugpy's messages read while the link opened


# One session per rank, whichever relay (and kernel) opened it: debugpy takes one client.
_links: dict[int, _Link] = {}
_ids = itertools.count(1)
_last_end = [0.0]  # when a session's connection last ended (time.monotonic)


def _end(entry: _Link, why: str) -> None:
    """End a session from this side, on the loop its streams belong to (another relay's,
    for a session another kernel opened): half-close, so that debugpy closes its side
    first; the pump then reads the end, reports DapClosed and returns."""
    entry.why = entry.why or why
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is entry.loop:
        _half_close(entry)
    elif not entry.loop.is_closed():
        entry.loop.call_soon_threadsafe(_half_close, entry)


def _half_close(entry: _Link) -> None:
    writer = entry.writer
    if writer.is_closing():
        return
    try:
        writer.write_eof()
    except OSError:
        writer.close()
        return
    entry.loop.call_later(END_WAIT_S, writer.close)  # debugpy never answered the end: stop waiting


async def _until_accepted(entry: _Link) -> None:
    """Read debugpy's first messages (kept for the pump) until the adapter has finished
    accepting this client, or ACCEPT_WAIT_S has passed (its last event may have gone to an
    older session that is still ending)."""
    deadline = time.monotonic() + ACCEPT_WAIT_S
    while not any(m.get("type") == "event" and m.get("event") == ACCEPTED for m in entry.early):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            data = await asyncio.wait_for(entry.reader.read(READ_CHUNK), left)
        except asyncio.TimeoutError:
            return
        if not data:
            raise ConnectionError("this rank's debugpy closed the connection as it was opened (another debugger "
                                  "may hold it); try again")
        entry.early.extend(entry.frames.feed(data))


class DapRelay(Actor):
    """Relays one DAP session between the kernel and this rank's debugpy.

    ``open(port, lease_s)`` connects (and ends the session before, even another kernel's:
    debugpy takes one client), ``pump(link)`` runs for the session's life and sends
    debugpy's messages to ``port`` as they arrive, ``send(link, messages)`` writes the
    kernel's requests, ``renew(link)`` says the kernel is still there, ``close(link)`` ends
    it.  A session the kernel stops renewing (it died: nothing else would tell a detached
    mesh's rank) ends after ``lease_s``, and debugpy then resumes the rank as when any
    client goes.  Every endpoint is async (so strict mode accepts the class); ``pump`` is
    concurrent, so it keeps reading while the others are called.
    """

    def __init__(self):
        # Runs on this actor's worker thread: keep debugpy from tracing (and suspending) it.
        threading.current_thread().pydev_do_not_trace = True

    @endpoint
    async def where(self) -> dict:
        """This rank's ``RankHost``, encoded."""
        return RankHost(socket.gethostname(), hosts.host_key(), hosts.ipv4_addresses()).encode()

    @endpoint
    async def open(self, port: Port, lease_s: float = 30.0) -> int:
        """Connect to this rank's debugpy; the link's number, for the other endpoints."""
        if rank_debugpy.started() is None:
            raise RuntimeError("debugpy is not running on this rank; %mesh debug R starts it")
        olds = list(_links.values())
        for old in olds:
            _end(old, "a new session took over")
        deadline = time.monotonic() + END_WAIT_S
        while any(not old.ended.is_set() for old in olds) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # only while a session ends: never on a request's path
        settle = _last_end[0] + SETTLE_S - time.monotonic()
        if settle > 0:
            await asyncio.sleep(settle)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(sock=rank_debugpy.open_client()),
                                                CONNECT_TIMEOUT_S)
        entry = _Link(reader, writer, port, asyncio.get_running_loop(), lease_s)
        try:
            await _until_accepted(entry)
        except BaseException:
            writer.close()
            raise
        link = next(_ids)
        _links[link] = entry
        return link

    @endpoint(concurrent=True)
    async def pump(self, link: int) -> str:
        """Forward what debugpy sends on ``link`` until the connection ends; why it ended."""
        entry = _links.get(link)
        if entry is None:
            return f"the relay has no connection {link}"
        loop = asyncio.get_running_loop()

        def check_lease() -> None:
            if time.monotonic() - entry.heard > entry.lease_s:
                _end(entry, f"the kernel did not renew the session within {entry.lease_s:g} s")
            elif not entry.writer.is_closing():
                loop.call_later(entry.lease_s / 2, check_lease)

        loop.call_later(entry.lease_s / 2, check_lease)
        frames = entry.frames
        reason = "debugpy closed the connection"
        try:
            if entry.early:
                entry.port.send(DapFrames(link, entry.early).encode())
                entry.early = []
            while True:
                data = await entry.reader.read(READ_CHUNK)
                if not data:
                    break
                messages = frames.feed(data)
                if messages:
                    entry.port.send(DapFrames(link, messages).encode())
        except SendFailed as e:  # before OSError: it is a ConnectionError
            reason = f"the kernel stopped reading the tunnel: {e}"
        except (OSError, ValueError) as e:  # a broken connection, or bytes that are not DAP
            reason = f"the relay's connection to debugpy failed: {e}"
        finally:
            if _links.get(link) is entry:
                del _links[link]
            entry.writer.close()
            _last_end[0] = time.monotonic()
            entry.ended.set()
            try:
                entry.port.send(DapClosed(link, entry.why or reason).encode())
            except SendFailed:
                pass  # the kernel is gone: nobody to tell
        return entry.why or reason

    def _link(self, link: int) -> _Link:
        entry = _links.get(link)
        if entry is None or entry.why:
            raise ConnectionError(f"the relay's connection {link} to debugpy is closed")
        entry.heard = time.monotonic()
        return entry

    @endpoint
    async def send(self, link: int, messages: list) -> None:
        """Write the kernel's DAP messages to debugpy, in order."""
        entry = self._link(link)
        for msg in messages:
            entry.writer.write(encode(msg))
        await entry.writer.drain()

    @endpoint
    async def renew(self, link: int) -> None:
        """The kernel is still there (it says so when it has sent nothing for a while)."""
        self._link(link)

    @endpoint
    async def close(self, link: int) -> None:
        """End ``link`` (its pump then reports ``DapClosed``)."""
        entry = _links.get(link)
        if entry is not None:
            _end(entry, "the kernel closed it")
