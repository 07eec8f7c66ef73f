"""A rank's start as a fork of the template: what the template prepares so a fork is cheap,
and the forked child's first moments, until it runs as a rank.

Apart from the template's loop (``server``) because this is the part that changes
when what a rank inherits changes: the modules imported before the first fork, the pipes
that become its stdio, and what the child drops of the template (its selector, socket,
pipes and signal handlers) before it runs the rank.  Like the template, it imports the
rank's modules only when called, never at import time.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys

from ..spawn.launch_config import LaunchConfig
from .process_tree import become_subreaper, die_with_parent
from .stack_sampler import rank_tracer

PIPE_SIZE = 1 << 20  # a rank's big write needs fewer wake-ups


def warm_up(modules: list[str]) -> None:
    """Import what every rank needs before the first fork, so each fork starts warm: the rank
    entry (and with it the runtime), and the modules the controller named (the public
    classes ranks unpickle; the upper layers name them, see ``Runtime.warm``)."""
    import importlib

    from .. import rank  # noqa: F401
    from ..wire import native

    native.sockets()  # the wire's C extension too, bound to libzmq once, so forks share it
    for name in modules:
        importlib.import_module(name)
    torch = sys.modules.get("torch")  # a fork of a process with a CUDA context is broken
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"importing {', '.join(modules)} initialised CUDA in the template; a rank forked from "
                           "it could not use the GPU (leave that module to the ranks)")


def rank_pipes() -> list[tuple[int, int]]:
    """A new rank's stdout, stderr and control pipes, ``(read, write)`` each, made before the
    fork (the output pipes grown); none is left open if one cannot be made."""
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


def leave_template(sel: selectors.BaseSelector, sock: socket.socket, fds: list[int]) -> None:
    """In the forked child, first: its own process group (its subprocesses end with it), none
    of the template's selector, socket and pipes (``fds``), and signals as a new process has
    them, so nothing of the template's loop runs in a rank."""
    os.setpgid(0, 0)
    become_subreaper()
    sel.close()
    for f in fds:
        os.close(f)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sock.close()


def become_rank(wire_config: dict, fds: list[int], template_pid: int) -> None:
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
        from ..rank import run_rank

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
