"""debugpy on a rank, started on demand: what JupyterLab's debugger (through the kernel) or
VS Code attaches to, and the cell sources and namespace it is shown.

Runs in rank processes (the console calls it).  It must never start debugpy unless asked,
never listen beyond loopback unless the user named another host, and never change the
environment at import.
"""

from __future__ import annotations

import os
import socket
import threading

_listen_lock = threading.Lock()
_listening: tuple[str, int] | None = None
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


def listening() -> tuple[str, int] | None:
    """The (host, port) debugpy listens on in this rank, if it was started."""
    return _listening


def listen(host: str = "127.0.0.1") -> tuple[str, int]:
    """Start debugpy in this rank (once); the (host, port) a DAP client connects to."""
    global _listening
    with _listen_lock:
        if _listening is not None:
            return _listening
        quiet_pydevd()
        _untrace_io_thread()
        import debugpy

        # Ranks are not meant to spawn debugged children of their own.
        debugpy.configure(subProcess=False)
        got = debugpy.listen((host, 0))
        _reply_at_once()
        _listening = (str(got[0]), int(got[1]))
        return _listening


def _untrace_io_thread() -> None:
    """Keep debugpy off the runtime's IO thread (before it starts, so it is never traced).
    Stopping at a breakpoint suspends every traced thread, and on a rank of another host the
    IO thread is the one that hands calls to the actors, the relay and the inspector included:
    traced, the stopped rank could show neither its stack nor its variables.  It runs no
    user code, so no breakpoint is lost; heartbeats go on while the rank is stopped."""
    from ...runtime.process import Runtime

    rt = Runtime.existing()
    if rt is not None and not rt.io.is_current():
        rt.io.thread.pydev_do_not_trace = True  # type: ignore[attr-defined]


def _reply_at_once() -> None:
    """pydevd writes each message's header and body with two sends on its socket to the
    debug adapter; without TCP_NODELAY the second waits for the adapter's delayed ACK, and
    every response takes ~40 ms more.  (debugpy's own socket: nothing of ours travels on it.)"""
    try:
        import pydevd  # type: ignore[import-not-found]  # on sys.path once debugpy.server set it up, as listen() has

        sock = pydevd.get_global_debugger().writer.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (ImportError, AttributeError, OSError):
        pass  # another debugpy: slower answers, nothing worse


def write_source(path: str, text: str) -> None:
    """Put a cell's text where the debugger will look for it (same path on every host)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def package_dir() -> str:
    """The monarch_kernel package folder: its frames are skipped when stepping."""
    here = os.path.abspath(__file__)  # monarch_kernel/debug/rank/rank_debugpy.py
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))
