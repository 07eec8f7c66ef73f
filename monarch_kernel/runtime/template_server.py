"""Runs in the template process: a pre-started interpreter that forks rank processes on request.

It imports what ranks need once and holds no threads and no ZeroMQ context, so a fork is safe
and a new rank costs a fork, not an interpreter start.  It reads its ranks' output and
control pipes and forwards them to the controller in batches.  It must never import the rank's modules
at import time (only in ``serve()``), nor be imported by the controller.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import time
from typing import NoReturn

from . import config
from .host_wire import (
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
from .launch import LaunchConfig
from .limits import limit_error, raise_nofile_limit
from .process_tree import become_subreaper, children_of_self, die_with_parent, end_tree
from .stack_sampler import StackSampler, rank_tracer
from .template_wire import ControlReader, Outbox, recv_msg

SWEEP_AFTER_S = (config.seconds("orphan_sweep_first"), config.seconds("orphan_sweep_last"))
READ_SIZE = 1 << 16
BATCH_BYTES = 48 << 10  # output is forwarded in messages of about this size (the socket takes ~200 KiB)
BEATS_S = config.seconds("template_beats")
PIPE_SIZE = 1 << 20  # a rank's big write needs fewer wake-ups


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
    ``python -c "from monarch_kernel.runtime.template_server import serve; serve()" FD PARENT_PID``.

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
    _warm_up(sys.argv[3:])

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, _Rank] = {}
    by_fd: dict[int, _Rank] = {}
    stdin = sys.stdin.fileno()
    cleanup: list[str] = []  # the controller's run directory, if it is ours to remove
    sweeps: list[float] = []  # monotonic times at which to end orphans of dead ranks
    out = Outbox(sock)
    sel = selectors.DefaultSelector()  # epoll: thousands of pipes, past select()'s 1,024
    sampler = StackSampler(sel, lambda tag, pid, status, o, e: out.send(StackDump(tag, pid, status, o, e)))
    for f in (sock.fileno(), wake_r, stdin):
        sel.register(f, selectors.EVENT_READ)
    sock.setblocking(False)
    out.send(Ready(nofile))
    batch: list = []  # output read this turn: [[pid, fd, data], ...], sent as one message
    batch_bytes = 0
    next_beats = time.monotonic() + BEATS_S
    reading = True  # False while the outbox is full (backpressure on the ranks' output)

    def flush_batch():
        nonlocal batch, batch_bytes
        if batch:
            out.send(Output(batch))
            batch, batch_bytes = [], 0

    def read_pipe(rank: _Rank, f: int) -> bool:
        """One read of a rank's pipe; False at EOF (then it is closed) or when empty."""
        nonlocal batch_bytes
        try:
            data = os.read(f, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            sel.unregister(f)
            os.close(f)
            del rank.fds[f]
            by_fd.pop(f, None)
            return False
        kind = rank.fds[f]
        if kind == 0:
            control(rank, data)
        else:
            batch.append([rank.pid, kind, data])
            batch_bytes += len(data)
            if batch_bytes >= BATCH_BYTES:
                flush_batch()
        return True

    def control(rank: _Rank, data: bytes):
        for frame in rank.control.feed(data):
            if not frame:
                rank.beat = True
            else:
                flush_batch()  # what it printed before its hello comes first
                out.send(Hello(rank.pid, frame))

    def release(rank: _Rank):
        """A rank exited: forward what its pipes still hold, then close them."""
        for f in list(rank.fds):
            while f in rank.fds and read_pipe(rank, f):
                pass
            if f in rank.fds:
                sel.unregister(f)
                os.close(f)
                by_fd.pop(f, None)
        rank.fds.clear()

    def sweep():
        """End every child that is not a rank: a descendant of a rank that died (ranks are
        subreapers themselves, so a live rank's orphans never come here)."""
        for pid in children_of_self():
            if pid not in children and not sampler.owns(pid):
                end_tree(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def reap():
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if sampler.reaped(pid, status):
                continue
            rank = children.pop(pid, None)
            if rank is None:
                continue  # an orphan we ended
            end_tree(pid)  # the rank's subprocesses go with it
            release(rank)
            flush_batch()
            sweep()
            now = time.monotonic()
            sweeps.extend(now + d for d in SWEEP_AFTER_S)
            out.send(Exit(pid, status))

    def shutdown() -> NoReturn:
        for pid in list(children):
            end_tree(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sweep()
        for d in cleanup:
            import shutil

            shutil.rmtree(d, ignore_errors=True)
        os._exit(0)

    def fork(msg: Fork) -> None:
        # The config is decoded in the child: a bad one costs that rank, not the template.
        if not cleanup:
            cleanup.extend(msg.config.get("cleanup_dirs") or [])
        try:
            fds = _rank_pipes()
        except OSError as e:
            out.send(ForkFailed(msg.tag, limit_error(e, "pipes for a new rank")))
            return
        (out_r, out_w), (err_r, err_w), (ctl_r, ctl_w) = fds
        try:
            pid = os.fork()
        except OSError as e:
            for f in (out_r, out_w, err_r, err_w, ctl_r, ctl_w):
                os.close(f)
            out.send(ForkFailed(msg.tag, limit_error(e, "a new process")))
            return
        if pid == 0:
            os.setpgid(0, 0)  # its own process group: its subprocesses end with it
            become_subreaper()
            sel.close()
            for f in [wake_r, wake_w, out_r, err_r, ctl_r, *by_fd]:
                os.close(f)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sock.close()
            _become_rank(msg.config, [out_w, err_w, ctl_w], os.getppid())
        for f in (out_w, err_w, ctl_w):
            os.close(f)
        rank = children[pid] = _Rank(pid, out_r, err_r, ctl_r)
        for f in (out_r, err_r, ctl_r):
            os.set_blocking(f, False)
            by_fd[f] = rank
            if reading or rank.fds[f] == 0:
                sel.register(f, selectors.EVENT_READ)
        try:
            os.setpgid(pid, pid)  # also here, so a kill right after the fork finds the group
        except (ProcessLookupError, PermissionError):
            pass
        out.send(Forked(msg.tag, pid))

    def set_reading(on: bool) -> None:
        """Stop (or start again) reading the ranks' output while the outbox is full."""
        nonlocal reading
        if on == reading:
            return
        reading = on
        for f, rank in by_fd.items():
            if rank.fds.get(f) in (1, 2):
                if on:
                    sel.register(f, selectors.EVENT_READ)
                else:
                    sel.unregister(f)

    signal.signal(signal.SIGTERM, lambda *_: shutdown())
    if pending_term:
        shutdown()

    while True:
        now = time.monotonic()
        timeout = max(0.0, next_beats - now)
        if sweeps:
            if min(sweeps) <= now:
                sweeps[:] = [t for t in sweeps if t > now]
                sweep()
            if sweeps:
                timeout = min(timeout, max(0.0, min(sweeps) - now))
        if sampler.next_deadline is not None:
            timeout = min(timeout, max(0.0, sampler.next_deadline - now))
        if out.queue:
            timeout = min(timeout, 0.01)  # the socket had no room: try again soon
        try:
            events = sel.select(timeout)
        except InterruptedError:
            continue
        for key, _mask in events:
            f = key.fd
            if f == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                reap()
            elif f == stdin:
                if not os.read(stdin, 4096):  # the controller is gone
                    shutdown()
            elif f == sock.fileno():
                while True:
                    try:
                        msg, _fds = recv_msg(sock)
                    except BlockingIOError:
                        break
                    except MalformedMessage:
                        continue
                    except OSError:
                        msg = None
                    if msg is None:
                        shutdown()
                    elif type(msg) is Fork:
                        fork(msg)
                    elif type(msg) is Stacks:
                        for pid in msg.pids:
                            if pid not in children:
                                out.send(StackDump(msg.tag, pid, -1, b"", b"not a live rank of this template"))
                        sampler.start(msg.tag, [p for p in msg.pids if p in children], msg.native)
                    elif type(msg) is Drain:  # read each rank's pipes dry, send it, then say so
                        for f, owner in list(by_fd.items()):
                            for _ in range(64):  # at most 4 MiB a pipe: a rank printing on does not hold us
                                if owner.fds.get(f) not in (1, 2) or not read_pipe(owner, f):
                                    break
                        flush_batch()
                        out.send(Drained(msg.tag))
                    elif type(msg) is Kill:
                        try:
                            os.kill(msg.pid, msg.signal)
                        except ProcessLookupError:
                            pass
            elif not sampler.readable(f):
                rank = by_fd.get(f)
                if rank is not None:
                    read_pipe(rank, f)
        sampler.tick()
        flush_batch()
        now = time.monotonic()
        if now >= next_beats:
            beats = [r.pid for r in children.values() if r.beat]
            for r in children.values():
                r.beat = False
            if beats:
                out.send(Beats(beats))
            next_beats = now + BEATS_S
        out.flush()
        set_reading(not out.full)


def _rank_pipes() -> list[tuple[int, int]]:
    made: list[tuple[int, int]] = []
    try:
        for _ in range(3):
            made.append(os.pipe())
    except OSError:
        for r, w in made:
            os.close(r)
            os.close(w)
        raise
    for r, _w in made[:2]:
        _grow_pipe(r)
    return made


def _grow_pipe(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (ImportError, AttributeError, OSError):  # not Linux, or over pipe-max-size: keep the default
        pass


def _warm_up(modules: list[str]) -> None:
    """Import what every rank needs before the first fork, so each fork starts warm: the rank
    entry (and with it the runtime), and the modules the controller named (the public
    classes ranks unpickle; the upper layers name them, see ``Runtime.warm``)."""
    import importlib

    from . import native, rank  # noqa: F401

    native.sockets()  # the wire's C extension too, bound to libzmq once, so forks share it
    for name in modules:
        importlib.import_module(name)


def _become_rank(wire_config: dict, fds: list[int], template_pid: int) -> None:
    """In the forked child: take the rank's stdio (``fds``: stdout, stderr, and the control
    pipe for its hello and heartbeats), then run it until it exits."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        control = fds[2]
        for f in fds[:2]:
            os.close(f)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        # typeshed marks these Final; the rank's own stdio is what they must name from here on.
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
        die_with_parent(template_pid)
        rank_tracer(template_pid)
        from .rank import run_rank

        run_rank(LaunchConfig.from_wire(wire_config), template_pid, control)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
