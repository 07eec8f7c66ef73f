"""debugpy's adapter for one debuggee (a rank, or the kernel), run so that no other user can
reach it.  It takes DAP clients only as connected sockets its debuggee hands it over a private
socket pair, or from a listening socket the debuggee hands it the same way (the kernel's), and
every TCP port it opens or takes (pydevd's way in, the kernel's client port) takes a connection
only from the debuggee's own user (``peer_uid``).

``spawn`` and ``trace`` run in the debuggee, in place of ``debugpy.listen`` (which would listen
for clients on a TCP port anyone on the machine may connect to, take the adapter's report of
its ports on another such port, and put pydevd's token on the adapter's command line);
``main(FD)`` runs in the adapter, the debuggee's child (FD: its end of the pair).  The adapter
must never listen for clients unless handed a port, never take a secret from its command line
or environment, and never outlive its debuggee's debugpy.  Importing it does nothing.

The pair carries, debuggee to adapter: ``{"token": ...}`` (pydevd's access token) first, then
``client`` or ``serve`` messages, each with one file descriptor (a connected socket to take as a
client; a listening socket to take every client from);
adapter to debuggee, once: ``{"server": [host, port]}`` (where pydevd connects) or ``{"error": why}``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading

from . import peer_uid

CLIENT = b"client"
SERVE = b"serve"
ADAPTER_MAIN = ("import sys; sys.path += sys.argv[2:]; "
                "from monarch_kernel.debug.debug_adapter import main; sys.exit(main(sys.argv[1]))")


def _refuse(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _accept(listener: socket.socket, handler, name: str) -> None:
    """Hand ``handler`` each connection of this user on ``listener``; close the others unread."""
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
        try:
            handler(sock)
        except Exception:  # a client that left as it came: the next one must still be taken
            log.swallow_exception("{0} connection from {1} failed:", name, address, level="warning")
            _refuse(sock)


def _serve_this_user(name, handler, host, port=0, backlog=socket.SOMAXCONN, timeout=None):
    """``debugpy.common.sockets.serve``, taking connections only from this user."""
    from debugpy.common import sockets

    listener = sockets.create_server(host, port, backlog, timeout)
    threading.Thread(target=_accept, args=(listener, handler, name), name=f"accept {name}",
                     daemon=True).start()
    return listener


class _Handover:
    """Takes the debuggee's messages on the pair: clients, and ports that take every client
    (the kernel's, where ipykernel's debugger connects)."""

    def __init__(self, control: socket.socket):
        self.control = control

    def run(self) -> None:
        from debugpy.adapter import clients
        from debugpy.common import log

        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.control, 64, 4)
            except OSError:
                msg, fds = b"", []
            if not msg:  # the debuggee is gone (it holds the pair for its whole life)
                # Its clients' sessions may never see their ends go (a relay's pair whose rank was
                # killed mid-session), and nothing is left to debug: the adapter goes with it.
                os._exit(0)
            socks = [socket.socket(fileno=fd) for fd in fds]
            if msg == CLIENT and len(socks) == 1:
                try:
                    clients.Client(socks[0])
                except Exception:  # the relay went away as it came; keep taking the next ones
                    log.swallow_exception("A client handed over by the debuggee failed:", level="warning")
                    _refuse(socks[0])
            elif msg == SERVE and len(socks) == 1:
                threading.Thread(target=_accept, args=(socks[0], clients.Client, "Client"),
                                 name="accept clients", daemon=True).start()
            else:
                for s in socks:
                    _refuse(s)


def main(fd: str) -> int:
    """The adapter process, given its end of the pair to its debuggee."""
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
    # Nothing more for the debuggee's output: stderr is its pipe, and may outlive it.
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    threading.Thread(target=_Handover(control).run, name="handover", daemon=True).start()
    servers.wait_until_disconnected()
    sessions.wait_until_ended()
    servers.stop_serving()
    return 0



def spawn(token: str, timeout: float) -> tuple[socket.socket, subprocess.Popen, tuple[str, int]]:
    """Start this process's adapter; the pair to it, the process, and where pydevd connects."""
    import debugpy

    import monarch_kernel

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # This process's sys.path may come from its start-up, not PYTHONPATH: the adapter appends
    # where monarch_kernel and debugpy are (appended: they never hide the standard library).
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(monarch_kernel.__file__))),
             os.path.dirname(os.path.dirname(debugpy.__file__))]
    try:
        adapter = subprocess.Popen([sys.executable, "-c", ADAPTER_MAIN, str(theirs.fileno()), *paths],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   start_new_session=True)  # an interrupt of our process group is not for it
    finally:
        theirs.close()
    try:
        ours.settimeout(timeout)
        ours.send(json.dumps({"token": token}).encode())
        data = ours.recv(1 << 16)
        if not data:
            raise RuntimeError("debugpy's adapter exited as it started (its error is in this process's stderr)")
        reply = json.loads(data)
        if "error" in reply:
            raise RuntimeError(f"debugpy's adapter did not start: {reply['error']}")
        ours.settimeout(None)
        host, port = reply["server"]
        return ours, adapter, (str(host), int(port))
    except TimeoutError:
        adapter.kill()
        ours.close()
        raise RuntimeError(f"debugpy's adapter did not start within {timeout:g} s") from None
    except BaseException:
        adapter.kill()
        ours.close()
        raise


def trace(server: tuple[str, int], token: str) -> None:
    """Connect pydevd to the adapter and trace from here on (this thread, and every thread
    started later), as ``debugpy.listen`` would."""
    import debugpy
    import pydevd  # type: ignore[import-not-found]  # on sys.path once debugpy.server is imported
    from debugpy.common.util import hide_debugpy_internals
    from pydevd_file_utils import absolute_path  # type: ignore[import-not-found]

    kwargs: dict = {}
    if hide_debugpy_internals():
        kwargs["dont_trace_start_patterns"] = (os.path.dirname(absolute_path(debugpy.__file__)),)
        kwargs["dont_trace_end_patterns"] = ("debugpy_launcher.py",)
    pydevd.settrace(host=server[0], port=server[1], suspend=False, patch_multiprocessing=False,
                    wait_for_ready_to_run=False, block_until_connected=True, access_token=token,
                    notify_stdin=False, **kwargs)


def start_here(timeout: float) -> tuple[socket.socket, subprocess.Popen]:
    """What ``debugpy.listen`` does for this process, with no port for clients: the adapter
    (our child, its pair returned) and pydevd tracing from here on.  ``debugpy.listen`` is
    marked as called, so a later call of it here raises rather than hangs."""
    from debugpy.server import api

    token = secrets.token_hex(32)
    control, adapter, server = spawn(token, timeout)
    try:
        trace(server, token)
    except BaseException:
        adapter.kill()
        control.close()
        raise
    api.listen.called = True
    return control, adapter
