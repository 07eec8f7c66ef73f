"""Runs in the template process: a pre-started interpreter that forks rank processes on request.

It imports what ranks need once and holds no threads and no ZeroMQ context, so a fork is safe
and a new rank costs a fork, not an interpreter start.  It reads its ranks' output and
control pipes and forwards them to the controller in batches.  What a fork carries and the
child's first moments are in ``fork``.  It must never import the rank's modules at
import time (only in ``serve()``), nor be imported by the controller.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
from typing import NoReturn

from .. import config
from ..limits import limit_error, raise_nofile_limit
from ..spawn.host_messages import (
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
    Output,
    Ready,
    StackDump,
    Stacks,
)
from ..spawn.rank_output import SYNC_MARK
from ..spawn.template_channel import ControlReader, Outbox, recv_msg
from .fork import become_rank, leave_template, rank_pipes, warm_up
from .process_tree import become_subreaper, children_of_self, die_with_parent, end_tree
from .stack_sampler import StackSampler

SWEEP_AFTER_S = (config.seconds("orphan_sweep_first"), config.seconds("orphan_sweep_last"))
READ_SIZE = 1 << 16
BATCH_BYTES = 48 << 10  # output is forwarded in messages of about this size (the socket takes ~200 KiB)
BEATS_S = config.seconds("template_beats")
# Once ranks' output has flowed for a while (turn after turn, for ten of these), the pipes rest
# this long after each turn that read some, while the controller's requests are still served at
# once: a rank printing flat out is then forwarded in chunks of many lines, not one or two, and
# every chunk costs the controller (its reader, the history) the same work.  A burst (a cell's
# few lines) goes at once, and so does the end-of-cell mark the kernel waits for.
GATHER_S = config.seconds("output_gather")
_SYNC = SYNC_MARK.encode()


# ---------------------------------------------------------------- the template process


class _Rank:
    """What the template holds for one rank it forked: the read ends of its stdout, stderr
    and control pipes (the control pipe carries its hello and its heartbeats)."""

    __slots__ = ("pid", "fds", "control", "beat")

    def __init__(self, pid: int, out_r: int, err_r: int, ctl_r: int):
        self.pid = pid
        self.fds = {out_r: 1, err_r: 2, ctl_r: 0}  # fd -> 1 stdout, 2 stderr, 0 control
        self.control = ControlReader()
        self.beat = False


def serve() -> None:
    """The template's main loop.  ``template_client`` starts it as
    ``python -c "from monarch_kernel.runtime.template.server import serve; serve()" FD PARENT_PID``.

    It dies with its controller (parent-death signal, plus EOF on the stdin pipe only the
    controller holds) and takes its ranks with it.  The job key arrives over the private
    socketpair, never on a command line or in the environment.  It reads every rank's
    stdout, stderr and control pipe and forwards them in batches, so the controller holds
    one socket per template, not pipes per rank.
    """
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # SIGTERM, not SIGKILL: the template still has to kill its ranks and clean up.
    pending_term: list = []
    signal.signal(signal.SIGTERM, lambda *_: pending_term.append(1))
    die_with_parent(parent_pid, signal.SIGTERM)
    become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    nofile = raise_nofile_limit()
    sock = socket.socket(fileno=fd)
    warm_up(sys.argv[3:])
    template = _Template(sock, nofile)
    signal.signal(signal.SIGTERM, lambda *_: template.shutdown())
    if pending_term:
        template.shutdown()
    template.run()


class _Template:
    """The template process: the ranks it forked, the read ends of their pipes, the output
    read but not yet sent, and its one socket to the controller.  One thread, one selector."""

    def __init__(self, sock: socket.socket, nofile: int):
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()  # SIGCHLD wakes the selector through this pipe
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: dict[int, _Rank] = {}
        self.by_fd: dict[int, _Rank] = {}
        self.stdin = sys.stdin.fileno()
        self.cleanup: list[str] = []  # the controller's run directory, if it is ours to remove
        self.sweeps: list[float] = []  # monotonic times at which to end orphans of dead ranks
        self.out = Outbox(sock)
        self.sel = selectors.DefaultSelector()  # epoll: thousands of pipes, past select()'s 1,024
        self.sampler = StackSampler(
            self.sel, lambda tag, pid, status, o, e: self.out.send(StackDump(tag, pid, status, o, e)))
        for f in (sock.fileno(), self.wake_r, self.stdin):
            self.sel.register(f, selectors.EVENT_READ)
        sock.setblocking(False)
        self.out.send(Ready(nofile))
        self.batch: list = []  # output read this turn: [[pid, fd, data], ...], sent as one message
        self.batch_bytes = 0
        self.next_beats = time.monotonic() + BEATS_S
        self.reading = True  # False while the outbox is full (backpressure on the ranks' output)
        self.read_output = False  # whether this turn read a rank's output
        self.synced = False  # ... and an end-of-cell mark in it (then no rest)
        self.flowing_since = self.last_output = 0.0  # output read turn after turn since; last read at
        # What is watched while the pipes rest: the controller's requests, its end, SIGCHLD
        self.requests = selectors.DefaultSelector()
        for f in (sock.fileno(), self.wake_r, self.stdin):
            self.requests.register(f, selectors.EVENT_READ)

    # ------------------------------------------------------------ the loop

    def run(self) -> NoReturn:
        while True:
            try:
                events = self.sel.select(self._timeout())
            except InterruptedError:
                continue
            for key, _mask in events:
                self._readable(key.fd)
            self.sampler.tick()
            self._flush_output()
            self._send_beats()
            self.out.flush()
            self._set_reading(not self.out.full)
            if self.read_output:
                self._after_output()

    def _after_output(self) -> None:
        """A turn read output: if it has flowed for ``10 * GATHER_S`` (no gap of over five),
        and no end-of-cell mark came, the pipes rest (``GATHER_S``)."""
        now = time.monotonic()
        if now - self.last_output > 5 * GATHER_S:
            self.flowing_since = now
        self.last_output = now
        synced, self.synced, self.read_output = self.synced, False, False
        if not synced and now - self.flowing_since >= 10 * GATHER_S:
            self._rest_pipes(GATHER_S)

    def _rest_pipes(self, seconds: float) -> None:
        """Serve only the controller's requests (a drain reads every pipe dry at once), its
        end and SIGCHLD for ``seconds``, while the ranks' output gathers in their pipes."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            try:
                events = self.requests.select(left)
            except InterruptedError:
                continue
            for key, _mask in events:
                self._readable(key.fd)
            if events:
                self._flush_output()
                self.out.flush()

    def _timeout(self) -> float:
        """Seconds until the next thing due: the heartbeats, an orphan sweep (ending any that
        are due now), the stack sampler, or a retry of a full socket."""
        now = time.monotonic()
        timeout = max(0.0, self.next_beats - now)
        if self.sweeps:
            if min(self.sweeps) <= now:
                self.sweeps[:] = [t for t in self.sweeps if t > now]
                self._end_orphans()
            if self.sweeps:
                timeout = min(timeout, max(0.0, min(self.sweeps) - now))
        if self.sampler.next_deadline is not None:
            timeout = min(timeout, max(0.0, self.sampler.next_deadline - now))
        if self.out.queue:
            timeout = min(timeout, 0.01)  # the socket had no room: try again soon
        return timeout

    def _readable(self, f: int) -> None:
        if f == self.wake_r:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
            self._reap()
        elif f == self.stdin:
            if not os.read(self.stdin, 4096):  # the controller is gone
                self.shutdown()
        elif f == self.sock.fileno():
            self._receive()
        elif not self.sampler.readable(f):
            rank = self.by_fd.get(f)
            if rank is not None:
                self._read_pipe(rank, f)

    def _send_beats(self) -> None:
        """Every ``BEATS_S``: the ranks whose control pipe said they are alive since the last."""
        now = time.monotonic()
        if now < self.next_beats:
            return
        beats = [r.pid for r in self.children.values() if r.beat]
        for r in self.children.values():
            r.beat = False
        if beats:
            self.out.send(Beats(beats))
        self.next_beats = now + BEATS_S

    # ------------------------------------------------------------ the controller's requests

    def _receive(self) -> None:
        while True:
            try:
                msg, _fds = recv_msg(self.sock)
            except BlockingIOError:
                return
            except MalformedMessage:
                continue
            except OSError:
                msg = None
            if msg is None:
                self.shutdown()
            elif type(msg) is Fork:
                self._fork(msg)
            elif type(msg) is Stacks:
                for pid in msg.pids:
                    if pid not in self.children:
                        self.out.send(StackDump(msg.tag, pid, -1, b"", b"not a live rank of this template"))
                self.sampler.start(msg.tag, [p for p in msg.pids if p in self.children], msg.native)
            elif type(msg) is Drain:
                self._drain(msg)
            elif type(msg) is Kill:
                try:
                    os.kill(msg.pid, msg.signal)
                except ProcessLookupError:
                    pass

    def _drain(self, msg: Drain) -> None:
        """Read each rank's pipes dry, send it, then say so."""
        for f, owner in list(self.by_fd.items()):
            for _ in range(64):  # at most 4 MiB a pipe: a rank printing on does not hold us
                if owner.fds.get(f) not in (1, 2) or not self._read_pipe(owner, f):
                    break
        self._flush_output()
        self.out.send(Drained(msg.tag))

    def _fork(self, msg: Fork) -> None:
        # The config is decoded in the child: a bad one costs that rank, not the template.
        if not self.cleanup:
            self.cleanup.extend(msg.config.get("cleanup_dirs") or [])
        try:
            fds = rank_pipes()
        except OSError as e:
            self.out.send(ForkFailed(msg.tag, limit_error(e, "pipes for a new rank")))
            return
        (out_r, out_w), (err_r, err_w), (ctl_r, ctl_w) = fds
        try:
            pid = os.fork()
        except OSError as e:
            for f in (out_r, out_w, err_r, err_w, ctl_r, ctl_w):
                os.close(f)
            self.out.send(ForkFailed(msg.tag, limit_error(e, "a new process")))
            return
        if pid == 0:
            leave_template(self.sel, self.sock, [self.wake_r, self.wake_w, self.requests.fileno(), out_r, err_r, ctl_r,
                                                 *self.by_fd])
            become_rank(msg.config, [out_w, err_w, ctl_w], os.getppid())
        for f in (out_w, err_w, ctl_w):
            os.close(f)
        rank = self.children[pid] = _Rank(pid, out_r, err_r, ctl_r)
        for f in (out_r, err_r, ctl_r):
            os.set_blocking(f, False)
            self.by_fd[f] = rank
            if self.reading or rank.fds[f] == 0:
                self.sel.register(f, selectors.EVENT_READ)
        try:
            os.setpgid(pid, pid)  # also here, so a kill right after the fork finds the group
        except (ProcessLookupError, PermissionError):
            pass
        self.out.send(Forked(msg.tag, pid))

    # ------------------------------------------------------------ the ranks' pipes

    def _read_pipe(self, rank: _Rank, f: int) -> bool:
        """One read of a rank's pipe; False at EOF (then it is closed) or when empty."""
        try:
            data = os.read(f, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._unwatch(f)
            os.close(f)
            del rank.fds[f]
            self.by_fd.pop(f, None)
            return False
        kind = rank.fds[f]
        if kind == 0:
            self._on_control(rank, data)
        else:
            self.read_output = True
            if _SYNC in data:
                self.synced = True
            self.batch.append([rank.pid, kind, data])
            self.batch_bytes += len(data)
            if self.batch_bytes >= BATCH_BYTES:
                self._flush_output()
        return True

    def _on_control(self, rank: _Rank, data: bytes) -> None:
        for frame in rank.control.feed(data):
            if not frame:
                rank.beat = True
            else:
                self._flush_output()  # what it printed before its hello comes first
                self.out.send(Hello(rank.pid, frame))

    def _flush_output(self) -> None:
        if self.batch:
            self.out.send(Output(self.batch))
            self.batch, self.batch_bytes = [], 0

    def _unwatch(self, f: int) -> None:
        """Stop watching a pipe that ends (not watched while the outbox is full: ``_set_reading``)."""
        try:
            self.sel.unregister(f)
        except KeyError:
            pass

    def _set_reading(self, on: bool) -> None:
        """Stop (or start again) reading the ranks' output while the outbox is full."""
        if on == self.reading:
            return
        self.reading = on
        for f, rank in self.by_fd.items():
            if rank.fds.get(f) in (1, 2):
                if on:
                    self.sel.register(f, selectors.EVENT_READ)
                else:
                    self.sel.unregister(f)

    # ------------------------------------------------------------ exits

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.sampler.reaped(pid, status):
                continue
            rank = self.children.pop(pid, None)
            if rank is None:
                continue  # an orphan we ended
            end_tree(pid)  # the rank's subprocesses go with it
            self._release(rank)
            self._flush_output()
            self._end_orphans()
            now = time.monotonic()
            self.sweeps.extend(now + d for d in SWEEP_AFTER_S)
            self.out.send(Exit(pid, status))

    def _release(self, rank: _Rank) -> None:
        """A rank exited: forward what its pipes still hold, then close them."""
        for f in list(rank.fds):
            while f in rank.fds and self._read_pipe(rank, f):
                pass
            if f in rank.fds:
                self._unwatch(f)
                os.close(f)
                self.by_fd.pop(f, None)
        rank.fds.clear()

    def _end_orphans(self) -> None:
        """End every child that is not a rank: a descendant of a rank that died (ranks are
        subreapers themselves, so a live rank's orphans never come here)."""
        for pid in children_of_self():
            if pid not in self.children and not self.sampler.owns(pid):
                end_tree(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def shutdown(self) -> NoReturn:
        for pid in list(self.children):
            end_tree(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._end_orphans()
        for d in self.cleanup:
            import shutil

            shutil.rmtree(d, ignore_errors=True)
        os._exit(0)
