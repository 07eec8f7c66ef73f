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

from ..runtime import rejects
from .messages import DapEvent, DapRequest, DapResponse, decode_dap

HEADER = b"Content-Length: "
SEPARATOR = b"\r\n\r\n"


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
    return HEADER + str(len(body)).encode("ascii") + SEPARATOR + body


class FrameError(ValueError):
    """Bytes that are not a DAP stream (``reason``: what is wrong, as counted); the stream
    cannot be read further."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class FrameReader:
    """Splits a byte stream into DAP messages (``Content-Length`` framed JSON objects).

    Anything else raises ``FrameError``, counted on this process's ``rejects`` as wire
    ``dap``: a header block over ``MAX_HEADER`` bytes, a missing or non-decimal length, a body
    over ``MAX_BODY`` (refused before it is buffered), or a body that is not a JSON object.
    """

    MAX_HEADER = 1024  # "Content-Length: N" and perhaps a Content-Type line
    MAX_BODY = 64 << 20  # a source or variables response is large; not this large

    def __init__(self):
        self._buf = bytearray()
        self._length: int | None = None  # the current message's, once its header is read

    def feed(self, data: bytes) -> list[dict]:
        try:
            return self._feed(data)
        except FrameError as e:
            rejects.count("dap", e.reason, str(e))
            raise

    def _feed(self, data: bytes) -> list[dict]:
        buf = self._buf
        buf.extend(data)
        out: list[dict] = []
        while True:
            if self._length is None:
                end = buf.find(SEPARATOR, 0, self.MAX_HEADER + len(SEPARATOR))
                if end < 0:
                    if len(buf) > self.MAX_HEADER:
                        raise FrameError("oversized", f"a DAP header block over {self.MAX_HEADER} bytes")
                    return out
                self._length = self._header_length(bytes(buf[:end]))
                del buf[:end + len(SEPARATOR)]
            if len(buf) < self._length:
                return out
            body = bytes(buf[:self._length])
            del buf[:self._length]
            self._length = None
            out.append(self._body(body))

    def _header_length(self, header: bytes) -> int:
        length = None
        for line in header.split(b"\r\n"):
            if line.startswith(HEADER):
                value = line[len(HEADER):].strip()
                if not value.isdigit():
                    raise FrameError("malformed", f"a DAP Content-Length that is not a number: {value[:40]!r}")
                length = int(value)
        if length is None:
            raise FrameError("malformed", f"DAP header without Content-Length: {header[:80]!r}")
        if length > self.MAX_BODY:
            raise FrameError("oversized", f"a DAP message of {length} bytes (at most {self.MAX_BODY})")
        return length

    @staticmethod
    def _body(body: bytes) -> dict:
        try:
            msg = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise FrameError("malformed", f"a DAP body that is not JSON: {e}") from None
        if not isinstance(msg, dict):
            raise FrameError("malformed", f"a DAP message is a JSON object, not {type(msg).__name__}")
        return msg


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
