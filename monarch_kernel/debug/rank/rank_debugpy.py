"""debugpy on a rank, started on demand: what JupyterLab's debugger (through the kernel) or
VS Code attaches to, and the cell sources and namespace it is shown.

Runs in rank processes (the console and the relay call it).  debugpy's adapter runs as this
rank's child (``debug/debug_adapter.py``) and takes DAP clients only as sockets handed to it here,
the relay's (``--listen``'s clients come through the relay too).  It must never start debugpy
unless asked, never listen for clients, and never change the environment at import.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import subprocess
import threading
from dataclasses import dataclass

from ...runtime import config, private_files
from .. import debug_adapter
from ..debug_adapter import CLIENT

START_TIMEOUT_S = config.seconds("debugpy_start_timeout")


@dataclass
class _Debugpy:
    ident: str  # tells this debugpy from a restarted rank's
    control: socket.socket  # the pair to the adapter: it takes clients and ports from here
    adapter: subprocess.Popen


_start_lock = threading.Lock()
_debugpy: _Debugpy | None = None
_namespace: dict = {}  # the console's namespace on this rank (share_namespace)


def share_namespace(ns: dict) -> None:
    """The console's namespace, for the inspector to show while the console is busy."""
    global _namespace
    _namespace = ns


def shared_namespace() -> dict:
    """The namespace the console shared (empty until it has)."""
    return _namespace


def quiet_pydevd() -> None:
    """Before pydevd is first imported here: ranks run without -Xfrozen_modules=off, and
    breakpoints in cells do not need it, so skip pydevd's warning about it."""
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def started() -> str | None:
    """This rank's debugpy's ident, if it was started."""
    return _debugpy.ident if _debugpy is not None else None


def start() -> str:
    """Start debugpy in this rank (once; on the thread whose code should be traced, with
    every thread started later); its ident, new in each process."""
    global _debugpy
    with _start_lock:
        if _debugpy is not None:
            return _debugpy.ident
        quiet_pydevd()
        _untrace_io_thread()
        import debugpy
        from debugpy.server import api

        if api.listen.called:
            raise RuntimeError("debugpy.listen() was already called in this rank, so the kernel cannot start its "
                               "own debugpy here; restart the rank (%mesh restart) and use %mesh debug R")
        # Ranks are not meant to spawn debugged children of their own.
        debugpy.configure(subProcess=False)
        control, adapter = debug_adapter.start_here(START_TIMEOUT_S)
        _reply_at_once()
        _debugpy = _Debugpy(secrets.token_hex(8), control, adapter)
        return _debugpy.ident


def _control() -> socket.socket:
    if _debugpy is None:
        raise RuntimeError("debugpy is not running on this rank; %mesh debug R starts it")
    return _debugpy.control


def _hand_over(kind: bytes, sock: socket.socket) -> None:
    try:
        socket.send_fds(_control(), [kind], [sock.fileno()])
    except OSError as e:
        raise ConnectionError(f"this rank's debug adapter is gone ({e}); restart the rank to debug it") from None


def open_client() -> socket.socket:
    """A new DAP connection to this rank's debugpy: one end of a socket pair whose other end
    the adapter takes as a client."""
    mine, theirs = socket.socketpair()
    try:
        _hand_over(CLIENT, theirs)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return mine


def loopback(host: str) -> str | None:
    """``host`` as a loopback address to listen on, or None if it is not one."""
    if host == "localhost":
        return "127.0.0.1"
    try:  # (not with a %zone: ::1%lo is loopback to ipaddress, and no address to listen on)
        return host if "%" not in host and ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def _untrace_io_thread() -> None:
    """Keep debugpy off the runtime's IO thread (before it starts, so it is never traced).
    Stopping at a breakpoint suspends every traced thread, and on a rank of another host the
    IO thread is the one that hands calls to the actors, the relay and the inspector included:
    traced, the stopped rank could show neither its stack nor its variables.  It runs no
    user code, so no breakpoint is lost; heartbeats go on while the rank is stopped."""
    from ...runtime import Runtime

    rt = Runtime.existing()
    if rt is not None and not rt.io.is_current():
        rt.io.thread.pydev_do_not_trace = True  # type: ignore[attr-defined]


def _reply_at_once() -> None:
    """pydevd writes each message's header and body with two sends on its socket to the
    debug adapter; without TCP_NODELAY the second waits for the adapter's delayed ACK, and
    every response takes ~40 ms more.  (debugpy's own socket: nothing of ours travels on it.)"""
    try:
        import pydevd  # type: ignore[import-not-found]  # on sys.path once debugpy.server is imported, as start() has

        sock = pydevd.get_global_debugger().writer.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (ImportError, AttributeError, OSError):
        pass  # another debugpy: slower answers, nothing worse


def write_source(path: str, text: str) -> None:
    """Put a cell's text where the debugger will look for it (same path on every host): a 0600
    file, never through a link, in the kernel's cell folder, which must be this user's alone
    (its name is predictable: another user may have made it first, to read cells or plant links)."""
    private_files.private_dir(os.path.dirname(path))
    data = text.encode("utf-8")
    try:
        if private_files.read_file(path, limit=len(data)) == data:
            return
    except (OSError, ValueError):  # not there yet, or not the same
        pass
    private_files.write_file(path, data)


def package_dir() -> str:
    """The monarch_kernel package folder: its frames are skipped when stepping."""
    here = os.path.abspath(__file__)  # monarch_kernel/debug/rank/rank_debugpy.py
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))
