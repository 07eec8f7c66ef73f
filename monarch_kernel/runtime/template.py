"""The template: a pre-started interpreter that forks rank processes on request.

It imports the runtime once, holds no threads and no ZeroMQ context, so a fork is safe and a
new rank costs a fork, not an interpreter start.  It dies with its controller (parent-death
signal, plus EOF on the stdin pipe only the controller holds) and takes its ranks with it.
The job key arrives over the private socketpair, never on a command line or in the
environment.  Started as ``python -c "...template import serve; serve()" FD PARENT_PID``.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_MAX_MSG = 1 << 20
SWEEP_AFTER_S = (0.2, 1.0)  # orphans of a dead rank reach the template soon after it exits


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent goes; exit if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the heartbeat still covers us
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def become_subreaper() -> None:
    """Orphaned descendants come to us instead of PID 1, so they can be ended."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _children_of_self() -> list[int]:
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # no /proc children file: scan every process's parent
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            found.append(int(name))
                except (OSError, ValueError, IndexError):
                    continue
        return found


def end_tree(pgid: int) -> None:
    """SIGKILL a rank's process group (its subprocesses share it unless they left)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _send(sock: socket.socket, msg: dict, fds=()) -> None:
    data = msgpack.packb(msg, use_bin_type=True)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket):
    data, ancdata, _flags, _addr = sock.recvmsg(_MAX_MSG, socket.CMSG_SPACE(16 * 4))
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - (len(cdata) % a.itemsize)])
            fds.extend(a)
    if not data:
        return None, fds
    return msgpack.unpackb(data, raw=False), fds


# ---------------------------------------------------------------- the template process


def serve() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # SIGTERM, not SIGKILL: the template still has to kill its ranks and clean up.
    pending_term: list = []
    signal.signal(signal.SIGTERM, lambda *_: pending_term.append(1))
    die_with_parent(parent_pid, signal.SIGTERM)
    become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    # Import what ranks need before forking, so each fork starts warm.
    from . import rank as rank_module  # noqa: F401  (also imports the runtime)
    import monarch_kernel  # noqa: F401  (public classes ranks unpickle)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    stdin = sys.stdin.fileno()
    cleanup: list[str] = []  # the controller's run directory, if it is ours to remove
    sweeps: list[float] = []  # monotonic times at which to end orphans of dead ranks

    def sweep():
        """End every child that is not a rank: a descendant of a rank that died (ranks are
        subreapers themselves, so a live rank's orphans never come here)."""
        for pid in _children_of_self():
            if pid not in children:
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
            if pid not in children:
                continue  # an orphan we ended
            children.discard(pid)
            end_tree(pid)  # the rank's subprocesses go with it
            sweep()
            now = time.monotonic()
            sweeps.extend(now + d for d in SWEEP_AFTER_S)
            try:
                _send(sock, {"op": "exit", "pid": pid, "status": status})
            except OSError:
                pass

    def shutdown():
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

    signal.signal(signal.SIGTERM, lambda *_: shutdown())
    if pending_term:
        shutdown()

    while True:
        timeout = None
        if sweeps:
            now = time.monotonic()
            if min(sweeps) <= now:
                sweeps[:] = [t for t in sweeps if t > now]
                sweep()
            timeout = max(0.0, min(sweeps) - now) if sweeps else None
        try:
            ready, _, _ = select.select([sock, wake_r, stdin], [], [], timeout)
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            reap()
        if stdin in ready:
            if not os.read(stdin, 4096):  # the controller is gone
                shutdown()
        if sock in ready:
            try:
                msg, fds = _recv(sock)
            except OSError:
                msg, fds = None, []
            if msg is None:
                shutdown()
            if msg.get("op") == "fork":
                if not cleanup:
                    cleanup.extend(msg["config"].get("cleanup_dirs") or [])
                pid = os.fork()
                if pid == 0:
                    os.setpgid(0, 0)  # its own process group: its subprocesses end with it
                    become_subreaper()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    sock.close()
                    _become_rank(msg["config"], fds, os.getppid())
                children.add(pid)
                try:
                    os.setpgid(pid, pid)  # also here, so a kill right after the fork finds the group
                except (ProcessLookupError, PermissionError):
                    pass
                for f in fds:
                    os.close(f)
                _send(sock, {"op": "forked", "tag": msg["tag"], "pid": pid})
            elif msg.get("op") == "kill":
                try:
                    os.kill(msg["pid"], msg.get("signal", signal.SIGKILL))
                except ProcessLookupError:
                    pass


def _become_rank(config: dict, fds: list[int], template_pid: int) -> None:
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds:
            os.close(f)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
        die_with_parent(template_pid)
        from .rank import run_rank

        run_rank(config, template_pid)
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


# ---------------------------------------------------------------- the controller's side


class TemplateClient:
    """The controller's handle on its template: fork ranks, hear about their exits.

    ``start`` must run on the IO thread: the parent-death signal is tied to the thread that
    started the template, and the IO thread lives as long as the process.
    """

    def __init__(self, loop, on_exit):
        self._loop = loop
        self._on_exit = on_exit
        here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = here
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from monarch_kernel.runtime.template import serve; serve()",
             str(there.fileno()), str(os.getpid())],
            stdin=subprocess.PIPE,
            pass_fds=[there.fileno()],
            start_new_session=True,
            env=env,
        )
        there.close()
        self._tags = 0
        self._waiting: dict[int, object] = {}
        self._lock = threading.Lock()
        self.alive = True
        loop.add_reader(here.fileno(), self._readable)

    def fork(self, config: dict, stdout_w: int, stderr_w: int, on_forked) -> None:
        """Ask for one rank; ``on_forked(pid)`` runs on the IO thread once it exists."""
        with self._lock:
            self._tags += 1
            tag = self._tags
            self._waiting[tag] = on_forked
        _send(self._sock, {"op": "fork", "tag": tag, "config": config}, [stdout_w, stderr_w])

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        try:
            _send(self._sock, {"op": "kill", "pid": pid, "signal": int(sig)})
        except OSError:
            pass

    def _readable(self) -> None:
        try:
            msg, _ = _recv(self._sock)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno == errno.EAGAIN:
                return
            msg = None
        if msg is None:
            self._loop.remove_reader(self._sock.fileno())
            self.alive = False
            self._on_exit(None, None)
            return
        if msg["op"] == "forked":
            with self._lock:
                cb = self._waiting.pop(msg["tag"], None)
            if cb is not None:
                cb(msg["pid"])
        elif msg["op"] == "exit":
            self._on_exit(msg["pid"], msg["status"])

    def close(self) -> None:
        """End the template and, with it, every rank it forked."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

