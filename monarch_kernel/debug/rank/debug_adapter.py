"""debugpy's adapter for one rank, run so that no other user can reach it.  It takes DAP
clients only as connected sockets its rank hands it over a private socket pair (the kernel's
relay, or the one client of a ``%mesh debug R --listen`` port), and every TCP port it opens
(pydevd's way in, the ``--listen`` port) takes a connection only from the rank's own user.

Runs as the rank's child process, ``main(FD)`` (FD: its end of the pair), started by
``rank_debugpy.start`` (``debugpy.listen`` would listen for clients on a TCP port
anyone on the machine may connect to, and put pydevd's token on the adapter's command line).
It must never listen for clients itself, never take a secret from its command line or
environment, and never outlive its rank's debugpy.  Importing it does nothing.

The pair carries, rank to adapter: ``{"token": ...}`` (pydevd's access token) first, then
``client`` or ``listen`` messages, each with one file descriptor (a connected socket to take
as a client; a listening socket to take one client from); adapter to rank, once:
``{"server": [host, port]}`` (where pydevd connects) or ``{"error": why}``.
"""

from __future__ import annotations

import json
import os
import socket
import threading

from . import peer_uid

CLIENT = b"client"
LISTEN = b"listen"


def _refuse(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _accept(listener: socket.socket, handler, name: str, once: bool) -> None:
    """Hand ``handler`` each connection of this user on ``listener`` (only the first, if
    ``once``: the listener then closes); close the others unread."""
    from debugpy.common import log

    while True:
        try:
            sock, address = listener.accept()
        except OSError:  # the listener was closed
            return
        try:
            mine = peer_uid.from_this_user(sock)
        except Exception:  # unreadable: nobody's (and this thread must go on taking connections)
            log.swallow_exception("Cannot tell whose {0} connection from {1} is:", name, address, level="warning")
            mine = False
        if not mine:
            log.warning("Refused a {0} connection from {1}: not this user's", name, address)
            _refuse(sock)
            continue
        if once:
            listener.close()
        try:
            handler(sock)
        except Exception:  # a client that left as it came: the next one must still be taken
            log.swallow_exception("{0} connection from {1} failed:", name, address, level="warning")
            _refuse(sock)
        if once:
            return


def _serve_this_user(name, handler, host, port=0, backlog=socket.SOMAXCONN, timeout=None):
    """``debugpy.common.sockets.serve``, taking connections only from this user."""
    from debugpy.common import sockets

    listener = sockets.create_server(host, port, backlog, timeout)
    threading.Thread(target=_accept, args=(listener, handler, name, False), name=f"accept {name}",
                     daemon=True).start()
    return listener


class _Handover:
    """Takes the rank's messages on the pair: clients, and the one pending ``--listen`` port."""

    def __init__(self, control: socket.socket):
        self.control = control
        self.pending: socket.socket | None = None  # a --listen port no client has used yet
        self.lock = threading.Lock()

    def run(self) -> None:
        from debugpy.adapter import clients, servers
        from debugpy.common import log

        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.control, 64, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:  # the rank is gone: if pydevd never came, nothing will
                if not servers.connections():
                    servers.dont_wait_for_first_connection()
                return
            socks = [socket.socket(fileno=fd) for fd in fds]
            if msg == CLIENT and len(socks) == 1:
                try:
                    clients.Client(socks[0])
                except Exception:  # the relay went away as it came; keep taking the next ones
                    log.swallow_exception("A client handed over by the rank failed:", level="warning")
                    _refuse(socks[0])
            elif msg == LISTEN and len(socks) == 1:
                self.listen(socks[0], clients.Client)
            else:
                for s in socks:
                    _refuse(s)

    def listen(self, listener: socket.socket, handler) -> None:
        """Take one client from ``listener``; a port given before and not used yet closes."""
        with self.lock:
            old, self.pending = self.pending, listener
        if old is not None:
            try:
                old.shutdown(socket.SHUT_RDWR)  # wakes its accept (closing alone would not)
            except OSError:
                pass
            _refuse(old)
        threading.Thread(target=_accept, args=(listener, handler, "Client", True), name="accept --listen",
                         daemon=True).start()


def main(fd: str) -> int:
    """The adapter process, given its end of the pair to the rank."""
    control = socket.socket(fileno=int(fd))
    hello = json.loads(control.recv(1 << 16) or b"{}")
    # Imported now, in debugpy's own order (its adapter modules import each other).
    from debugpy.adapter import clients, servers, sessions  # noqa: I001
    from debugpy.common import log, sockets

    log.to_file(prefix="debugpy.adapter")  # only where DEBUGPY_LOG_DIR asks for it
    # Every TCP port the adapter opens from here on (pydevd's now; a "launch" request's later)
    # takes connections only from this user.
    sockets.serve = _serve_this_user
    # It takes clients on no port (debugpy's own main would open one, which sets this; its
    # socket reports read it).
    clients.listener = None  # type: ignore[attr-defined]
    servers.access_token = hello.get("token")
    try:
        host, port = servers.serve(sockets.get_default_localhost())
    except Exception as e:
        control.send(json.dumps({"error": f"debugpy's adapter cannot listen for pydevd: {e}"}).encode())
        return 1
    control.send(json.dumps({"server": [host, port]}).encode())
    # Nothing more for the rank's output: stderr is the rank's pipe, and may outlive it.
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    threading.Thread(target=_Handover(control).run, name="handover", daemon=True).start()
    servers.wait_until_disconnected()
    sessions.wait_until_ended()
    servers.stop_serving()
    return 0

