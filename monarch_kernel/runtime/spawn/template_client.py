"""Runs in the controller (and in a host agent): its handle on a template process that forks
ranks.

It starts the template (``template/server.py``) and talks to it in ``host_messages`` messages over
``template_channel``; it never
imports the template's side, so the runtime's imports stay acyclic.  The template forwards
its ranks' output, hellos and heartbeats; they reach the ``TemplateEvents`` given here.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .. import config
from .host_messages import (
    Beats,
    Drain,
    Drained,
    Exit,
    Fork,
    Forked,
    ForkFailed,
    Hello,
    Kill,
    MalformedMessage,
    Message,
    Output,
    Ready,
    StackDump,
    Stacks,
)
from .launch_config import LaunchConfig
from .stack_dump import PendingDumps
from .template_channel import recv_msg, send_msg

# conftest.py recognises a template process by "template.server import serve" in its command line.
SERVE = "from monarch_kernel.runtime.template.server import serve; serve()"
END_GRACE_S = config.seconds("template_end_grace")  # a template told to end has this long, then is killed


class TemplateEvents(Protocol):
    """What a template tells its owner, on the IO thread.  ``exited(None, None)``: the
    template itself is gone, and its ranks with it."""

    def exited(self, pid: int | None, status: int | None, /) -> None: ...
    def output(self, pid: int, fd: int, data: bytes, /) -> None: ...
    def hello(self, pid: int, hello: bytes, /) -> None: ...
    def beats(self, pids: list, /) -> None: ...


class TemplateClient:
    """The controller's handle on one template: fork ranks, hear about them.

    Construct it on the IO thread: the parent-death signal is tied to the thread that
    started the template, and the IO thread lives as long as the process.  ``python`` is
    the interpreter the template (and so every rank it forks) runs.
    """

    def __init__(self, loop, events: TemplateEvents, warm: tuple[str, ...] = (), python: str = sys.executable):
        self._loop = loop
        self.events = events
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
        self._waiting: dict[int, tuple[Callable[[int], None], Callable[[str], None] | None]] = {}
        self._lock = threading.Lock()
        self.alive = True
        self.ranks = 0  # forked and not yet exited
        self.nofile: int | None = None  # the template's open-files limit, once it said
        self._handlers: dict[type, Callable] = {Output: self._output, Beats: lambda m: self.events.beats(m.pids),
                                                Hello: lambda m: self.events.hello(m.pid, m.hello),
                                                Forked: self._forked, ForkFailed: self._fork_failed,
                                                Exit: self._exited, Ready: self._ready,
                                                StackDump: lambda m: self._dumps.arrived(m),
                                                Drained: self._drained}
        self._dumps = PendingDumps()
        self._draining: dict[int, tuple[threading.Event, Callable[[], None] | None]] = {}
        loop.add_reader(here.fileno(), self._readable)

    def fork(self, config: LaunchConfig, on_forked, on_failed: Callable[[str], None] | None = None) -> None:
        """Ask for one rank; ``on_forked(pid)`` runs on the IO thread once it exists, or
        ``on_failed(why)`` if the template could not make it (a limit was reached)."""
        with self._lock:
            self._tags += 1
            tag = self._tags
            self._waiting[tag] = (on_forked, on_failed)
            self.ranks += 1
        send_msg(self._sock, Fork(tag, config.to_wire()))

    def stacks(self, pids: list[int], native: bool, on_dump: Callable[[StackDump], None]) -> None:
        """On the IO thread: ``py-spy dump`` each rank of ``pids`` (it is their parent, so
        ptrace_scope=1 allows it); ``on_dump`` hears one ``StackDump`` per pid."""
        with self._lock:
            self._tags += 1
            tag = self._tags
        self._dumps.add(tag, len(pids), on_dump)
        send_msg(self._sock, Stacks(tag, list(pids), bool(native)))

    def drain(self, then: Callable[[], None] | None = None) -> threading.Event:
        """Ask the template to send what its ranks have written so far; the event is set
        (and ``then`` called) on the IO thread once all of it has been handed to the events
        (``output``), or once the template is gone."""
        done = threading.Event()
        with self._lock:
            self._tags += 1
            tag = self._tags
            self._draining[tag] = (done, then)
        try:
            send_msg(self._sock, Drain(tag))
        except OSError:
            self._end_drain(tag)  # the template is gone: nothing more will come
        return done

    def _drained(self, msg: Drained) -> None:
        self._end_drain(msg.tag)

    def _end_drain(self, tag: int) -> None:
        with self._lock:
            done, then = self._draining.pop(tag, (None, None))
        if done is not None:
            done.set()
        if then is not None:
            then()

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        try:
            send_msg(self._sock, Kill(pid, int(sig)))
        except OSError:
            pass

    def _readable(self) -> None:
        for _ in range(64):  # a few at a time: other callbacks get their turn
            try:
                msg, _ = recv_msg(self._sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except MalformedMessage:
                continue  # not from our template's code: nothing to act on
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return
                msg = None
            if msg is None:
                self._loop.remove_reader(self._sock.fileno())
                self._sock.close()
                self.alive = False
                for tag in list(self._draining):
                    self._end_drain(tag)
                self.events.exited(None, None)
                return
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _output(self, msg: Output) -> None:
        for pid, fd, data in msg.items:
            self.events.output(pid, fd, data)

    def _forked(self, msg: Forked) -> None:
        with self._lock:
            cbs = self._waiting.pop(msg.tag, None)
        if cbs is not None:
            cbs[0](msg.pid)

    def _fork_failed(self, msg: ForkFailed) -> None:
        with self._lock:
            cbs = self._waiting.pop(msg.tag, None)
            self.ranks -= 1
        if cbs is not None and cbs[1] is not None:
            cbs[1](msg.error)

    def _exited(self, msg: Exit) -> None:
        with self._lock:
            self.ranks -= 1
        self.events.exited(msg.pid, msg.status)

    def _ready(self, msg: Ready) -> None:
        self.nofile = msg.nofile

    def close(self) -> None:
        """End the template and, with it, every rank it forked; waits for it (at exit)."""
        if self._tell_to_end():
            try:
                self.proc.wait(timeout=END_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def end_soon(self) -> None:
        """``close`` without waiting, for the IO thread: a standby replaced while it still
        imports torch takes seconds to read its EOF, and a loop held that long stops the
        agent's beats (its controller would declare the host gone).  It is killed after
        ``END_GRACE_S`` if it has not ended, and reaped from the loop."""
        if not self._tell_to_end():
            return
        deadline = time.monotonic() + END_GRACE_S

        def reap() -> None:
            if self.proc.poll() is not None:
                return
            if time.monotonic() >= deadline:
                self.proc.kill()
            self._loop.call_later(0.1, reap)

        self._loop.call_later(0.1, reap)

    def _tell_to_end(self) -> bool:
        """Close the template's stdin (its signal to end); False if it already exited."""
        if self.proc.poll() is not None:
            return False
        assert self.proc.stdin is not None  # stdin=PIPE: closing it tells the template to end
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        return True
