"""The kernel's end of the DAP tunnel: ``TunnelConnection`` is a DAP client whose requests
are calls to a rank's ``DapRelay`` and whose responses and events come back, as debugpy
sends them, to a channel of the kernel's.  Nothing opens a socket to the rank's debugpy: the
session rides the job's authenticated control connection, wherever the rank runs.

Runs in the kernel.  One thread per connection takes the channel's values in order and
answers the waiting requests (the runtime's IO thread only delivers them).  It must never
leave a request waiting once the rank is gone.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

from ...actor.errors import ActorError, MeshStopped
from ...actor.port import Channel, Port, PortReceiver
from ...runtime import Runtime, config, rejects
from ..dap import DapClient
from ..messages import DapClosed, DapFrames, decode_tunnel

OPEN_TIMEOUT_S = config.seconds("tunnel_open_timeout")
SEND_TIMEOUT_S = config.seconds("tunnel_send_timeout")
CLOSE_WAIT_S = config.seconds("tunnel_close_wait")
EXIT_TIMEOUT_S = config.seconds("tunnel_exit_timeout")
# The relay ends a session it has not heard of for LEASE_S (the kernel died: a detached
# mesh's rank must not stay stopped for it); an idle session is renewed every RENEW_S.
LEASE_S = config.seconds("tunnel_lease")
RENEW_S = config.seconds("tunnel_renew")

_open: weakref.WeakSet = weakref.WeakSet()  # sessions to close when the kernel exits
_exit_lock = threading.Lock()
_at_exit: list = []  # holds True once the exit handler is registered


def _close_all() -> None:
    for conn in list(_open):
        conn.close(EXIT_TIMEOUT_S)


class TunnelConnection(DapClient):
    """One DAP session with a rank's debugpy, through that rank's relay (an ``ActorMesh``
    of one ``DapRelay``).  ``label`` names the rank in error messages."""

    def __init__(self, relay, label: str, on_event: Callable[[dict], None],
                 on_close: Callable[[], None] | None = None):
        super().__init__(f"{label}'s debugpy (through the rank's relay)", on_event, on_close)
        self._relay = relay
        self._ended = threading.Event()  # a DapClosed came: nothing more will
        self._last_sent = time.monotonic()
        self._port: Port[dict]
        self._receiver: PortReceiver[dict]
        self._port, self._receiver = Channel.open()
        self.link = 0
        try:
            self.link = relay.open.call_one(self._port, LEASE_S).get(timeout=OPEN_TIMEOUT_S)
        except (ActorError, MeshStopped, OSError, TimeoutError) as e:
            Runtime.current().close_port(self._port.port_id)
            raise ConnectionError(f"cannot open {self.describe}: {_reason(e)}") from None
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"dap-tunnel-{label}", daemon=True)
        self._dispatcher.start()
        self._pump = relay.pump.call_one(self.link)
        self._pump.then(self._pump_ended)
        with _exit_lock:
            _open.add(self)
            if not _at_exit:  # the first session: a kernel that exits lets go of its ranks
                atexit.register(_close_all)
                _at_exit.append(True)

    def _send(self, msg: dict) -> None:
        self._last_sent = time.monotonic()
        try:
            self._relay.send.call_one(self.link, [msg]).get(timeout=SEND_TIMEOUT_S)
        except (ActorError, MeshStopped, OSError) as e:  # the rank, or its relay, is gone
            raise ConnectionError(_reason(e)) from None
        except TimeoutError:
            raise ConnectionError(f"the rank's relay did not take the request within {SEND_TIMEOUT_S:g} s "
                                  "(is the rank stuck in a long C call?)") from None

    def _dispatch(self) -> None:
        """Hand what the relay sent to the session, in order, until a DapClosed; renew
        the session while it is idle."""
        pending = None
        while True:
            if pending is None:
                pending = self._receiver.recv()
            try:
                value = pending.get(timeout=RENEW_S)
            except TimeoutError:
                self._renew_if_idle()
                continue  # the same Future: it still holds our place for the next value
            pending = None
            try:
                msg = decode_tunnel(value)
            except ValueError as e:
                rejects.count("tunnel", "malformed", str(e))
                continue  # not ours to guess at
            if isinstance(msg, DapFrames):
                self._received(msg.messages)
            elif isinstance(msg, DapClosed):
                self._ended.set()
                _open.discard(self)
                Runtime.current().close_port(self._port.port_id)
                self._shut(f"has disconnected: {msg.reason}")
                return

    def _renew_if_idle(self) -> None:
        if time.monotonic() - self._last_sent < RENEW_S or self._ended.is_set():
            return
        self._last_sent = time.monotonic()
        try:
            self._relay.renew.call_one(self.link).get(timeout=RENEW_S)
        except (ActorError, MeshStopped, OSError, TimeoutError):
            pass  # the rank is gone or the relay ended the session: its DapClosed says which

    def _pump_ended(self, fut) -> None:
        """The relay's pump call ended.  Returning, it sent its DapClosed first; failing (the
        rank died, or its relay was stopped), it could not: say it in its place."""
        error = fut.exception(timeout=0)
        if error is not None and not self._ended.is_set():
            self._port.send(DapClosed(self.link, f"the rank is gone ({_reason(error)})").encode())

    def close(self, timeout: float = SEND_TIMEOUT_S) -> None:
        """End the session: the relay closes its connection to debugpy (which resumes the
        rank, as any client's going does), and pending requests fail."""
        _open.discard(self)
        if not self._ended.is_set():
            try:
                self._relay.close.call_one(self.link).get(timeout=timeout)
            except (ActorError, MeshStopped, OSError, TimeoutError):
                pass  # the rank is gone or stuck: there is nothing left to close there
            if not self._ended.wait(min(timeout, CLOSE_WAIT_S)):
                self._port.send(DapClosed(self.link, "the kernel closed it").encode())
        self._shut("was closed")


def _reason(error: BaseException) -> str:
    """One line on why a call to the relay failed (the rank's own error, if it raised one)."""
    cause = error.__cause__ if isinstance(error, ActorError) and error.__cause__ is not None else error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")
