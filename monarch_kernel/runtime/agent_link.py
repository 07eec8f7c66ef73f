"""Runs in the controller: its link to the agent on one of its hosts, standing in for the
local template (``template_client``) when ranks are forked on that host.

The link speaks ``agent_wire`` over the runtime's own signed (and, between hosts, Curve)
messages.  Ranks' output arrives as OUTPUT messages and is written into the pipes the
supervisor reads, so remote output takes the same path as local output.  The link beats
every ``BEAT_S`` and declares the agent gone after ``SILENT_S`` of silence (a cut link, a dead
machine), or at once when its launcher says so (the ssh or srun process exited): every rank
it forked then dies with a reason that names the host.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from collections.abc import Callable

from . import agent_wire as wire
from .completion import Completion
from .launch import LaunchConfig


class AgentLink:
    """``host``: the name the job knows the host by (what deaths and ``%mesh status`` say)."""

    def __init__(self, runtime, host: str, on_exit: Callable[[int | None, int | None, str, str], None]):
        self.rt = runtime
        self.host = host
        self.id = "h" + secrets.token_hex(5)
        self.on_exit = on_exit  # (pid, status, link id, why) like the template's; pid None: the host is gone
        self.address: str | None = None  # the agent's inbox, from its UP
        self.info: dict = {}  # what the agent said of itself: hostname, pid, ip, python, version
        self.up = Completion()
        self.alive = True
        self.why_gone = ""
        self.last_heard = time.monotonic()
        self._tags = 0
        self._waiting: dict[int, Callable] = {}  # tag -> callback (on the IO thread)
        self._fds: dict[int, list[int]] = {}  # tag -> [stdout_w, stderr_w] of a forked rank
        self._pending: dict[int, bytearray] = {}  # fd -> bytes not yet written (the pipe was full)
        self._tag_of: dict[int, int] = {}  # pid -> tag
        self._reserving: dict[int, Completion] = {}  # tag -> the ports asked for

    @property
    def ip(self) -> str:
        return self.info.get("ip", "")

    def credentials(self, controller: str, bind: str | None = None) -> bytes:
        """The line to write to the agent's stdin (it holds the job's keys)."""
        assert self.rt.curve is not None
        return wire.credentials(self.id, self.rt.key, self.rt.curve, controller, bind, tuple(self.rt.warm_modules))

    # ------------------------------------------------------------ sending (any thread)

    def _send(self, msg: dict) -> bool:
        if self.address is None or not self.alive:
            return False
        h, body = wire.encode(self.id, self.rt.net_address or self.rt.address, msg)
        return self.rt.send_or_report(self.address, h, body, f"a {msg['op']} for the agent on {self.host}")

    def _tag(self, callback: Callable) -> int:
        self._tags += 1
        self._waiting[self._tags] = callback
        return self._tags

    def reserve_async(self, n: int) -> Completion:
        """``n`` free TCP ports on the host for ranks' inboxes: a completion (any thread)."""
        got = Completion()

        def ask():
            tag = self._tag(got.set_result)
            self._reserving[tag] = got
            if not self._send({"op": wire.RESERVE, "tag": tag, "n": n}):
                got.set_exception(ConnectionError(f"cannot reach the agent on {self.host}"
                                                  + (f": {self.why_gone}" if self.why_gone else "")))

        self.rt.io.call_soon(ask)
        return got

    def fork(self, config: LaunchConfig, stdout_w: int, stderr_w: int, on_forked) -> None:
        """On the IO thread: fork one rank there; its output goes into these pipes."""
        if not self.alive:
            raise OSError(errno.EPIPE, f"the agent on {self.host} is gone")
        fds = [os.dup(stdout_w), os.dup(stderr_w)]
        for fd in fds:
            os.set_blocking(fd, False)

        def forked(pid: int) -> None:
            self._tag_of[pid] = tag
            on_forked(pid)

        tag = self._tag(forked)
        self._fds[tag] = fds
        self._send({"op": wire.FORK, "tag": tag, "config": config.to_wire()})

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        self._send({"op": wire.KILL, "pid": pid, "signal": int(sig)})

    def close(self) -> None:
        """End the agent and every rank on it (it exits on its own when we do, too)."""
        self._send({"op": wire.BYE})

    # ------------------------------------------------------------ hearing (IO thread)

    def beat(self, now: float) -> None:
        """Every second: beat, and declare the agent gone once it has been silent too long."""
        if not self.alive or self.address is None:
            return
        if now - self.last_heard > wire.SILENT_S:
            self.gone(f"its agent has been silent for {now - self.last_heard:.1f} s "
                      f"(the host is down or its network link is cut)")
            return
        self._send({"op": wire.BEAT})

    def on_message(self, origin: str, msg: dict) -> None:
        self.last_heard = time.monotonic()
        op = msg["op"]
        if op == wire.UP:
            self.address = origin
            self.info = {k: msg.get(k) for k in ("hostname", "pid", "ip", "python", "version")}
            if not self.up.done():
                self.up.set_result(True)
        elif op in (wire.FORKED, wire.PORTS):
            self._reserving.pop(msg.get("tag", -1), None)
            cb = self._waiting.pop(msg.get("tag", -1), None)
            if cb is not None:
                cb(msg["pid"] if op == wire.FORKED else msg["ports"])
        elif op == wire.OUTPUT:
            fds = self._fds.get(msg.get("tag", -1))
            if fds is not None and msg.get("fd") in (1, 2):
                self._write(fds[msg["fd"] - 1], msg["data"])
        elif op == wire.EXIT:
            tag = self._tag_of.pop(msg["pid"], msg.get("tag", -1))
            for fd in self._fds.pop(tag, []):
                self._flush_and_close(fd)
            self.on_exit(msg["pid"], msg["status"], self.id, "")

    def _write(self, fd: int, data: bytes) -> None:
        pending = self._pending.get(fd)
        if pending is not None:
            pending.extend(data)
            return
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            n = 0
        except OSError:
            return  # the reader is gone
        if n < len(data):
            self._pending[fd] = bytearray(data[n:])
            self.rt.io.loop.add_writer(fd, self._drain, fd)

    def _drain(self, fd: int) -> None:
        pending = self._pending.get(fd)
        if pending is None:
            return
        try:
            n = os.write(fd, pending)
        except BlockingIOError:
            return
        except OSError:
            n = len(pending)
        del pending[:n]
        if not pending:
            del self._pending[fd]
            self.rt.io.loop.remove_writer(fd)

    def _flush_and_close(self, fd: int) -> None:
        if fd in self._pending:
            self.rt.io.loop.remove_writer(fd)
            os.set_blocking(fd, True)  # the rank has exited: what is left is bounded; let it out
            try:
                os.write(fd, bytes(self._pending.pop(fd)))
            except OSError:
                pass
        try:
            os.close(fd)
        except OSError:
            pass

    def gone(self, why: str) -> None:
        """On the IO thread: the agent (and so every rank it forked) is gone; ``why`` says how."""
        if not self.alive:
            return
        self.alive = False
        self.why_gone = why
        for fds in self._fds.values():
            for fd in fds:
                self._flush_and_close(fd)
        self._fds.clear()
        self._waiting.clear()  # ranks never forked die below, with the rest (pid None)
        for got in self._reserving.values():
            if not got.done():
                got.set_exception(ConnectionError(f"the agent on {self.host} is gone: {why}"))
        if not self.up.done():
            self.up.set_exception(ConnectionError(f"the agent on {self.host} is gone: {why}"))
        self.on_exit(None, None, self.id, why)
