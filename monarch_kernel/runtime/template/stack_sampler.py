"""Runs in the template process: ``py-spy dump`` of the ranks it forked, for ``%mesh stacks``.

The template is every rank's parent, so py-spy started here may read a rank's memory even
under ``kernel.yama.ptrace_scope=1`` and as a non-root user (each rank names its template
as its tracer with ``PR_SET_PTRACER`` when it starts; see ``rank_tracer``).  py-spy reads
the stack from outside the interpreter: it works on a rank stuck in C code, holding the
GIL, or stopped.  The sampler never blocks the template's loop: each py-spy is a child
whose output pipe the template's selector watches, at most ``PARALLEL`` at a time, each
killed after ``stack_dump`` seconds.
"""

from __future__ import annotations

import collections
import ctypes
import os
import selectors
import signal
import sys
import sysconfig
import time
from collections.abc import Callable

from .. import config

PARALLEL = 8  # py-spy processes at once, per template
LIMIT = 160 << 10  # bytes of one dump the template forwards (its socket takes one ~200 KiB datagram)
PR_SET_PTRACER = 0x59616D61


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter (a pip install puts it there), or on PATH."""
    here = os.path.join(sysconfig.get_path("scripts"), "py-spy")
    if os.access(here, os.X_OK):
        return here
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, "py-spy")
        if d and os.access(p, os.X_OK):
            return p
    return None


def rank_tracer(parent: int) -> None:
    """In a new rank: let its template (and the py-spy it starts) read it under Yama's
    ptrace_scope=1.  Harmless where Yama is absent."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(parent), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, or a tracer's stop)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


class _Job:
    __slots__ = ("tag", "pid", "spy", "out", "err", "data", "errors", "deadline", "status", "open")

    def __init__(self, tag: int, pid: int):
        self.tag, self.pid = tag, pid
        self.spy: int | None = None  # py-spy's pid, once started
        self.out = self.err = -1
        self.data = bytearray()
        self.errors = bytearray()
        self.deadline = 0.0
        self.status: int | None = None  # py-spy's exit status, once reaped
        self.open = 0  # its pipes still open


class StackSampler:
    """``start(tag, pids, native)`` queues a dump of each pid; ``done(tag, pid, status,
    stdout, stderr)`` is called once per pid (status -1: py-spy is missing or could not
    start, and stderr says why).  The template calls ``readable(fd)`` for each ready fd,
    ``reaped(pid, status)`` for each child it reaps, and ``tick()`` every turn."""

    def __init__(self, sel: selectors.BaseSelector, done: Callable[[int, int, int, bytes, bytes], None]):
        self.sel = sel
        self.done = done
        self.queue: collections.deque = collections.deque()
        self.running: dict[int, _Job] = {}  # py-spy pid -> job
        self.by_fd: dict[int, _Job] = {}
        self.timeout = config.seconds("stack_dump")

    def start(self, tag: int, pids: list[int], native: bool) -> None:
        for pid in pids:
            self.queue.append((_Job(tag, pid), native))
        self._fill()

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is one of our py-spy processes (the template must not sweep it)."""
        return pid in self.running

    @property
    def next_deadline(self) -> float | None:
        return min((j.deadline for j in self.running.values()), default=None)

    def readable(self, fd: int) -> bool:
        """Read one of our pipes; False when ``fd`` is not ours."""
        job = self.by_fd.get(fd)
        if job is None:
            return False
        buf = job.data if fd == job.out else job.errors
        try:
            chunk = os.read(fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            chunk = b""
        if chunk:
            if len(buf) < LIMIT:
                buf.extend(chunk[: LIMIT - len(buf)])
            return True
        self.sel.unregister(fd)
        os.close(fd)
        del self.by_fd[fd]
        job.open -= 1
        self._finish(job)
        return True

    def reaped(self, pid: int, status: int) -> bool:
        job = self.running.get(pid)
        if job is None:
            return False
        job.status = os.waitstatus_to_exitcode(status)
        self._finish(job)
        return True

    def tick(self) -> None:
        now = time.monotonic()
        for job in list(self.running.values()):
            if now >= job.deadline and job.spy is not None:
                job.errors.extend(f"py-spy did not finish within {self.timeout:g} s".encode())
                try:
                    os.kill(job.spy, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                job.deadline = float("inf")

    def _fill(self) -> None:
        while self.queue and len(self.running) < PARALLEL:
            job, native = self.queue.popleft()
            self._spawn(job, native)

    def _spawn(self, job: _Job, native: bool) -> None:
        exe = py_spy()
        if exe is None:
            self.done(job.tag, job.pid, -1, b"", b"py-spy is not installed here (pip install py-spy)")
            return
        args = [exe, "dump", "--pid", str(job.pid), "--json"]
        if _stopped(job.pid):
            args.append("--nonblocking")  # py-spy cannot suspend a stopped process; its memory reads as it is
        elif native:
            args.append("--native")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            job.spy = os.posix_spawn(exe, args, dict(os.environ), file_actions=[
                (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
        except OSError as e:
            for f in (out_r, out_w, err_r, err_w):
                os.close(f)
            self.done(job.tag, job.pid, -1, b"", f"py-spy would not start: {e}".encode())
            return
        finally:
            if job.spy is not None:
                os.close(out_w)
                os.close(err_w)
        job.out, job.err, job.open = out_r, err_r, 2
        job.deadline = time.monotonic() + self.timeout
        self.running[job.spy] = job
        for f in (out_r, err_r):
            os.set_blocking(f, False)
            self.by_fd[f] = job
            self.sel.register(f, selectors.EVENT_READ)

    def _finish(self, job: _Job) -> None:
        if job.open or job.status is None:
            return  # both pipes at EOF and the process reaped
        assert job.spy is not None
        del self.running[job.spy]
        self.done(job.tag, job.pid, job.status, bytes(job.data), bytes(job.errors[-4096:]))
        self._fill()
