"""The kernel's own debugpy (JupyterLab's debugger on the kernel itself), started so that no
other user can reach it: its adapter is the kernel's child (``debug/debug_adapter.py``), and
the loopback port ipykernel's debugger connects to takes a connection only from the kernel's
own user, as does pydevd's port.  ``debugpy.listen`` would take anyone's.

Runs in the kernel, on the thread to trace first (the shell's: ipykernel's debugger runs
``listen`` through an execute request, ``%mesh debug off`` from its cell).  It must never
start debugpy unless asked, never listen beyond loopback, and never change anything at import.
"""

from __future__ import annotations

import socket
import subprocess
import threading

from ...runtime import config
from .. import debug_adapter
from ..rank import rank_debugpy

START_TIMEOUT_S = config.seconds("debugpy_start_timeout")
# What ipykernel's debugger executes to start it (no name is left in the user's namespace).
LISTEN_CODE = "__import__('monarch_kernel.debug.controller.kernel_debugpy', fromlist=['listen']).listen({!r}, {})"

_lock = threading.Lock()
_adapter: tuple[socket.socket, subprocess.Popen] | None = None  # the pair to the adapter, and its process
_served: set[tuple[str, int]] = set()  # client ports handed to the adapter


def listen(host: str, port: int) -> None:
    """Start the kernel's debugpy (once; tracing this thread and every later one) and have its
    adapter take every DAP client of this user on ``host:port`` (a loopback address)."""
    global _adapter
    address = rank_debugpy.loopback(host)
    if address is None:
        raise ValueError(f"the kernel's debugger listens only on a loopback address (127.0.0.1 or ::1), not {host!r}")
    with _lock:
        if _adapter is None:
            from debugpy.server import api

            if api.listen.called:
                raise RuntimeError("debugpy.listen() was already called in this kernel, so JupyterLab's debugger "
                                   "cannot start its own debugpy here; restart the kernel to use the debugger")
            _adapter = debug_adapter.start_here(START_TIMEOUT_S)
        if (address, port) in _served:
            return
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as listener:
            listener.bind((address, port))
            listener.listen(8)
            try:
                socket.send_fds(_adapter[0], [debug_adapter.SERVE], [listener.fileno()])
            except OSError as e:
                raise ConnectionError(f"the kernel's debug adapter is gone ({e}); restart the kernel to debug "
                                      f"it") from None
        _served.add((address, port))
