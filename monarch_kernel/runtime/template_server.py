"""Runs in the template process: a pre-started interpreter that forks rank processes on request.

It imports what ranks need once and holds no threads and no ZeroMQ context, so a fork is safe
and a new rank costs a fork, not an interpreter start.  It must never import the rank's modules
at import time (only in ``serve()``), nor be imported by the controller.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import time
from typing import NoReturn

from .launch import LaunchConfig
from .template_wire import EXIT, FORK, FORKED, KILL, recv_msg, send_msg

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
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


# ---------------------------------------------------------------- the template process


def serve() -> None:
    """The template's main loop.  ``template_client`` starts it as
    ``python -c "from monarch_kernel.runtime.template_server import serve; serve()" FD PARENT_PID``.

    It dies with its controller (parent-death signal, plus EOF on the stdin pipe only the
    controller holds) and takes its ranks with it.  The job key arrives over the private
    socketpair, never on a command line or in the environment.
    """
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # SIGTERM, not SIGKILL: the template still has to kill its ranks and clean up.
    pending_term: list = []
    signal.signal(signal.SIGTERM, lambda *_: pending_term.append(1))
    die_with_parent(parent_pid, signal.SIGTERM)
    become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    _warm_up(sys.argv[3:])

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
                send_msg(sock, {"op": EXIT, "pid": pid, "status": status})
            except OSError:
                pass

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
                msg, fds = recv_msg(sock)
            except OSError:
                msg, fds = None, []
            if msg is None:
                shutdown()
            if msg.get("op") == FORK:
                # The config is decoded in the child: a bad one costs that rank, not the template.
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
                send_msg(sock, {"op": FORKED, "tag": msg["tag"], "pid": pid})
            elif msg.get("op") == KILL:
                try:
                    os.kill(msg["pid"], msg.get("signal", signal.SIGKILL))
                except ProcessLookupError:
                    pass


def _warm_up(modules: list[str]) -> None:
    """Import what every rank needs before the first fork, so each fork starts warm: the rank
    entry (and with it the runtime), and the modules the controller named (the public
    classes ranks unpickle; the upper layers name them, see ``Runtime.warm``)."""
    import importlib

    from . import rank  # noqa: F401

    for name in modules:
        importlib.import_module(name)


def _become_rank(wire_config: dict, fds: list[int], template_pid: int) -> None:
    """In the forked child: take the rank's stdio, then run it until it exits."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds:
            os.close(f)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        # typeshed marks these Final; the rank's own stdio is what they must name from here on.
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
        die_with_parent(template_pid)
        from .rank import run_rank

        run_rank(LaunchConfig.from_wire(wire_config), template_pid)
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
