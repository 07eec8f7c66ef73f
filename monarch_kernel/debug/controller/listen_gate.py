"""``%mesh debug R --listen``: a loopback port on the kernel's machine where VS Code (or any DAP
client) attaches to rank R, wherever the rank runs.  A client gets in only if it proves it is
the user's twice: its socket is the user's (``peer_uid``), and its ``attach`` request carries
the one-session secret printed in the launch.json entry.  Only then does a byte reach the rank:
the session rides the rank's relay (``tunnel.py``), over the mesh's own authenticated connection.

Runs in the kernel.  The uid alone is not enough: through an ssh forward (VS Code on a laptop,
the kernel on a login node) every connection is the user's own ssh, whoever made it.  The gate
must never pass a message to the rank before the secret matches, never hold a stranger's bytes
unbounded, and never let a refused client close the port on the user.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time

from ...runtime import config, rejects
from ..dap import FrameError, FrameReader, encode
from ..peer_uid import from_this_user
from .tunnel import TunnelConnection

SECRET_FIELD = "monarchSessionSecret"  # the launch.json field VS Code passes in attach's arguments
SCREEN_S = config.seconds("listen_screen_timeout")
MAX_SCREENING = 8  # clients proving themselves at once; more are closed at once
MAX_SCREEN_BYTES = 64 << 10  # what a client may send before it has proven itself
# The first answer to initialize, before the rank is reached; the rank's debugpy's own
# capabilities follow as a ``capabilities`` event once the client has proven itself.
FIRST_CAPABILITIES = {"supportsConfigurationDoneRequest": True}


class Refused(Exception):
    """A client that did not prove itself (``str``: why, as logged and counted)."""


def _response(request: dict, success: bool, body: dict | None = None, message: str = "") -> dict:
    msg = {"type": "response", "seq": 0, "request_seq": request.get("seq", 0), "command": request.get("command"),
           "success": success}
    if body is not None:
        msg["body"] = body
    if message:
        msg["message"] = message
    return msg


class _Bridge(TunnelConnection):
    """A proven client's session with the rank: every message the rank sends goes to the
    client as is, except debugpy's answer to the client's initialize, which the gate already
    answered: it goes as a ``capabilities`` event."""

    def __init__(self, relay, label: str, client: socket.socket, initialize_seq: int):
        self._client = client
        self._initialize_seq = initialize_seq
        self._write_lock = threading.Lock()
        super().__init__(relay, label, lambda _m: None, self._client_gone)

    def forward(self, msg: dict) -> None:
        self._send(msg)

    def _received(self, messages: list[dict]) -> None:
        out = []
        for msg in messages:
            if (msg.get("type") == "response" and msg.get("command") == "initialize"
                    and msg.get("request_seq") == self._initialize_seq):
                msg = {"type": "event", "seq": 0, "event": "capabilities",
                       "body": {"capabilities": msg.get("body") or {}}}
            out.append(encode(msg))
        with self._write_lock:
            try:
                self._client.sendall(b"".join(out))
            except OSError:
                self.close()

    def _client_gone(self) -> None:
        try:
            self._client.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ListenGate:
    """One ``--listen`` port: takes the first client that proves itself, then closes.

    ``relay`` is the rank's ``DapRelay``; ``label`` names the rank.  ``secret`` goes in the
    printed launch.json entry as ``SECRET_FIELD``.
    """

    def __init__(self, relay, label: str, host: str = "127.0.0.1"):
        self.relay, self.label = relay, label
        self.secret = secrets.token_urlsafe(32)
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.bind((host, 0))
        self._listener.listen(16)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._screening = 0
        self.taken = threading.Event()  # a client proved itself: the port is closed
        self.bridge: _Bridge | None = None
        threading.Thread(target=self._accept, name=f"dap-listen-{label}", daemon=True).start()

    def close(self) -> None:
        """Stop taking clients (a session already under way goes on)."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes its accept (closing alone would not)
        except OSError:
            pass
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _address = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                busy = self._screening >= MAX_SCREENING or self.taken.is_set()
                if not busy:
                    self._screening += 1
            if busy or not _mine(sock):
                rejects.count("dap_listen", "busy" if busy else "other_user", "")
                _drop(sock)
                continue
            threading.Thread(target=self._screen, args=(sock,), name=f"dap-screen-{self.label}",
                             daemon=True).start()

    def _screen(self, sock: socket.socket) -> None:
        try:
            initialize, attach, rest, reader = self._prove(sock)
        except Refused as e:
            rejects.count("dap_listen", "refused", str(e))
            _drop(sock)
            return
        finally:
            with self._lock:
                self._screening -= 1
        with self._lock:
            if self.taken.is_set():  # another proven client came first
                _drop(sock)
                return
            self.taken.set()
        self.close()
        sock.settimeout(None)
        try:
            bridge = _Bridge(self.relay, self.label, sock, initialize.get("seq", 0))
        except ConnectionError as e:
            _fail(sock, attach, str(e))
            return
        self.bridge = bridge
        args = {k: v for k, v in (attach.get("arguments") or {}).items() if k != SECRET_FIELD}
        try:
            for msg in (initialize, {**attach, "arguments": args}, *rest):
                bridge.forward(msg)
        except ConnectionError:
            bridge.close()
            return
        _pipe(sock, bridge, reader)

    def _prove(self, sock: socket.socket) -> tuple[dict, dict, list[dict], FrameReader]:
        """Read the client's initialize (answered here) and attach (checked here); the two
        requests, what came after them in the same read, and the reader (with any part of a
        message after them), or Refused.  Nothing reaches the rank meanwhile."""
        reader, initialize, got = FrameReader(), None, 0
        deadline = time.monotonic() + SCREEN_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused(f"no attach with the session's secret within {SCREEN_S:g} s")
            sock.settimeout(left)
            try:
                data = sock.recv(4096)
            except OSError as e:
                raise Refused(f"the client went: {e}") from None
            got += len(data)
            if not data or got > MAX_SCREEN_BYTES:
                raise Refused("the client went" if not data else f"over {MAX_SCREEN_BYTES} bytes before attach")
            try:
                messages = reader.feed(data)
            except FrameError as e:
                raise Refused(str(e)) from None
            for i, msg in enumerate(messages):
                command = msg.get("command") if msg.get("type") == "request" else None
                if command == "initialize" and initialize is None:
                    initialize = msg
                    _send(sock, _response(msg, True, FIRST_CAPABILITIES))
                elif command == "attach" and initialize is not None:
                    given = (msg.get("arguments") or {}).get(SECRET_FIELD)
                    if isinstance(given, str) and hmac.compare_digest(given.encode(), self.secret.encode()):
                        return initialize, msg, messages[i + 1:], reader
                    _fail(sock, msg, f"this port takes a client whose attach carries the session's "
                                     f"{SECRET_FIELD!r}, as the printed launch.json entry does")
                    raise Refused("an attach without the session's secret")
                else:
                    _fail(sock, msg, "this port takes initialize, then attach with the session's secret")
                    raise Refused(f"{command or msg.get('type')!r} before a proven attach")


def _mine(sock: socket.socket) -> bool:
    try:
        return from_this_user(sock)
    except OSError:
        return False


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.sendall(encode(msg))
    except OSError as e:
        raise Refused(f"the client went: {e}") from None


def _fail(sock: socket.socket, request: dict, why: str) -> None:
    try:
        sock.sendall(encode(_response(request, False, message=why)))
    except OSError:
        pass
    _drop(sock)


def _drop(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _pipe(sock: socket.socket, bridge: _Bridge, reader: FrameReader) -> None:
    """Carry the proven client's requests to the rank until either side ends."""
    try:
        while not bridge.closed:
            data = sock.recv(1 << 16)
            if not data:
                break
            for msg in reader.feed(data):
                bridge.forward(msg)
    except (OSError, FrameError):  # ConnectionError included: the rank's side is gone
        pass
    finally:
        bridge.close()
        sock.close()
