"""A Debug Adapter Protocol client: how the kernel talks to a rank's debugpy, and the
``Content-Length`` framing DAP uses on a byte stream.

Runs in the kernel (``DapClient``, and ``DapConnection`` over TCP for tools and tests) and on
ranks (``FrameReader`` and ``encode``, in the relay).  Thread-based so that both the
kernel's control loop and the main thread can use it: each request gets its own sequence
number and a ``concurrent.futures.Future`` answered when its response arrives; events go to
a callback.  It must never interpret requests or answers: the debugger decides what to send.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import socket
import threading
from collections.abc import Callable

from .messages import DapEvent, DapRequest, DapResponse, decode_dap

HEADER = b"Content-Length: "
SEPARATOR = b"\r\n\r\n"


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
    return HEADER + str(len(body)).encode("ascii") + SEPARATOR + body


class FrameReader:
    """Splits a byte stream into DAP messages (``Content-Length`` framed JSON)."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        out: list[dict] = []
        while True:
            end = self._buf.find(SEPARATOR)
            if end < 0:
                return out
            length = None
            for line in self._buf[:end].split(b"\r\n"):
                if line.startswith(HEADER):
                    length = int(line[len(HEADER):])
            if length is None:
                raise ValueError(f"DAP header without Content-Length: {self._buf[:end]!r}")
            start = end + len(SEPARATOR)
            if len(self._buf) - start < length:
                return out
            out.append(json.loads(self._buf[start:start + length].decode("utf-8")))
            self._buf = self._buf[start + length:]


class DapClient:
    """The client half of one DAP session, whatever carries it: subclasses send encoded
    requests (``_send``) and hand what arrives to ``_received``, and ``_shut`` when the
    carrier is gone.  Pending requests then fail with ``ConnectionError``."""

    def __init__(self, describe: str, on_event: Callable[[dict], None], on_close: Callable[[], None] | None):
        self.describe = describe  # "the debug adapter at ...": for error messages
        self._on_event = on_event
        self._on_close = on_close
        self._seq = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # requests go out in the order of their numbers
        self.closed = False
        self.closed_why = ""  # how the session ended, once it has

    def _send(self, msg: dict) -> None:
        """Deliver one request; raise ConnectionError (or OSError) if it cannot go."""
        raise NotImplementedError

    def request(self, command: str, arguments: dict | None = None) -> concurrent.futures.Future:
        """Send a request; the Future holds the whole response message."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            with self._lock:
                if self.closed:
                    fut.set_exception(ConnectionError(f"{self.describe} {self.closed_why}"))
                    return fut
                seq = next(self._seq)
                self._pending[seq] = fut
            try:
                self._send(DapRequest(seq, command, arguments).encode())
            except OSError as e:  # ConnectionError included
                with self._lock:
                    self._pending.pop(seq, None)
                if not fut.done():
                    fut.set_exception(ConnectionError(f"cannot reach {self.describe}: {e}"))
        return fut

    def _received(self, messages: list[dict]) -> None:
        for msg in messages:
            typed = decode_dap(msg)
            if isinstance(typed, DapResponse):
                with self._lock:
                    fut = self._pending.pop(typed.request_seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)  # the whole message: the frontend gets it as is
            elif isinstance(typed, DapEvent):
                self._on_event(msg)

    def _shut(self, why: str = "closed the connection") -> None:
        with self._lock:
            if self.closed:
                return
            self.closed, self.closed_why = True, why
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.describe} {why}"))
        self._closed()
        if self._on_close is not None:
            self._on_close()

    def _closed(self) -> None:
        """Release the carrier (once, after the session is marked closed)."""

    def close(self) -> None:
        """End the session from this side; pending requests fail."""
        self._shut("was closed")


class DapConnection(DapClient):
    """One TCP connection to a debug adapter (what VS Code does; the kernel itself reaches
    ranks through ``tunnel.TunnelConnection`` instead)."""

    def __init__(self, host: str, port: int, on_event: Callable[[dict], None],
                 on_close: Callable[[], None] | None = None, timeout: float = 30.0):
        super().__init__(f"the debug adapter at {host}:{port}", on_event, on_close)
        self.address = (host, port)
        self._sock = socket.create_connection(self.address, timeout=timeout)
        self._sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name=f"dap-{host}:{port}", daemon=True)
        self._reader.start()

    def _send(self, msg: dict) -> None:
        self._sock.sendall(encode(msg))

    def _read(self) -> None:
        reader = FrameReader()
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                self._received(reader.feed(data))
        except (OSError, ValueError):
            pass
        finally:
            self._shut()

    def _closed(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._shut()
