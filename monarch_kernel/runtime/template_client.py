"""Runs in the controller: its handle on the template process that forks its ranks.

It starts the template (``template_server``) and talks to it over ``template_wire``; it never
imports the template's side, so the runtime's imports stay acyclic.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from .launch import LaunchConfig
from .template_wire import EXIT, FORK, FORKED, KILL, recv_msg, send_msg

# conftest.py recognises a template process by "template_server import serve" in its command line.
SERVE = "from monarch_kernel.runtime.template_server import serve; serve()"


class TemplateClient:
    """The controller's handle on its template: fork ranks, hear about their exits.

    Construct it on the IO thread: the parent-death signal is tied to the thread that
    started the template, and the IO thread lives as long as the process.  ``python`` is
    the interpreter the template (and so every rank it forks) runs.
    """

    def __init__(self, loop, on_exit, warm: tuple[str, ...] = (), python: str = sys.executable):
        self._loop = loop
        self._on_exit = on_exit
        here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = here
        self.python = python
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        try:
            self.proc = subprocess.Popen(
                # ``warm``: modules the template imports before forking (named by upper layers).
                [python, "-c", SERVE, str(there.fileno()), str(os.getpid()), *warm],
                stdin=subprocess.PIPE,
                pass_fds=[there.fileno()],
                start_new_session=True,
                env=env,
            )
        except BaseException:
            here.close()  # ``python`` would not start
            raise
        finally:
            there.close()
        self._tags = 0
        self._waiting: dict[int, Callable[[int], None]] = {}
        self._lock = threading.Lock()
        self.alive = True
        loop.add_reader(here.fileno(), self._readable)

    def fork(self, config: LaunchConfig, stdout_w: int, stderr_w: int, on_forked) -> None:
        """Ask for one rank; ``on_forked(pid)`` runs on the IO thread once it exists."""
        with self._lock:
            self._tags += 1
            tag = self._tags
            self._waiting[tag] = on_forked
        send_msg(self._sock, {"op": FORK, "tag": tag, "config": config.to_wire()}, [stdout_w, stderr_w])

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        try:
            send_msg(self._sock, {"op": KILL, "pid": pid, "signal": int(sig)})
        except OSError:
            pass

    def _readable(self) -> None:
        try:
            msg, _ = recv_msg(self._sock)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno == errno.EAGAIN:
                return
            msg = None
        if msg is None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self.alive = False
            self._on_exit(None, None)
            return
        if msg["op"] == FORKED:
            with self._lock:
                cb = self._waiting.pop(msg["tag"], None)
            if cb is not None:
                cb(msg["pid"])
        elif msg["op"] == EXIT:
            self._on_exit(msg["pid"], msg["status"])

    def close(self) -> None:
        """End the template and, with it, every rank it forked."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None  # stdin=PIPE: closing it tells the template to end
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
