"""``%pip`` and ``%conda`` in a ``%%mesh`` cell run once per host, not once per rank: the ranks
of a host share one environment, and several installers at once in one environment break it.

The ranks of a host meet at a file lock in the runtime's private folder on that host (every
rank of a mesh on one host shares it).  The lowest rank of the host that reaches the command
claims the lock (each higher rank gives the ones below it a moment, ``STAGGER_S``, first),
runs it and leaves its result in a file; the others wait at the lock and read that file
instead of running it again.  A rank that fails before its turn, or dies holding the lock,
lets the others go on (the lock goes with its process).  Then every rank of the host sees
what was installed (``importlib.invalidate_caches``).
Runs on ranks; importing it changes nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import socket
import stat
import time

from ..runtime import config, process_mesh, rank_label

COMMANDS = ("pip", "conda", "mamba", "micromamba", "uv")  # IPython's magics that install packages
STAGGER_S = config.seconds("host_once_stagger")  # the k-th rank of a host lets the ranks below it go first k times this
POLL_S = config.seconds("host_once_poll")


class HostOnceError(RuntimeError):
    """A command that ran once for this host failed on the rank that ran it."""


class HostOnce:
    """Runs a package magic once for the ranks of this host that reach it in the same cell."""

    def __init__(self, rundir: str):
        self.folder = os.path.join(rundir, "host-once")
        self.token = ""
        self.seq = 0  # package magics this cell has run so far

    def install(self, shell) -> None:
        """Put the once-per-host versions of IPython's package magics in ``shell``."""
        for name in COMMANDS:
            original = shell.find_line_magic(name)  # IPython's own (loading it now if lazy)
            if original is not None:
                shell.register_magic_function(self._magic(name, original, shell), "line", name)

    def cell_starts(self, token: str) -> None:
        self.token, self.seq = token, 0

    def _magic(self, name: str, original, shell):
        def magic(line: str = ""):
            self.seq += 1
            self.run(name, lambda: original(line), shell.user_ns)

        magic.__doc__ = (f"%{name} on a rank: runs once for all ranks of this host (they share one "
                         f"environment).\n\n{original.__doc__ or ''}")
        return magic

    def run(self, name: str, command, ns: dict) -> None:
        """``command()`` once per host for the ``self.seq``-th package magic of this cell."""
        mesh, rank = process_mesh
        hosts = tuple(mesh.hosts) if mesh is not None else ()
        here = [r for r, h in enumerate(hosts) if h == hosts[rank]] if hosts else [rank]
        if len(here) <= 1:  # alone on this host
            command()
            _settle()
            return
        folder = _private_folder(self.folder)
        key = os.path.join(folder, f"{self.token}-{self.seq}")
        fd = _claim(key, STAGGER_S * here.index(rank))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held already by a claim; else waits (the stop button ends it)
            done = _read(key + ".json")
            if done is None:
                print(f"%{name} runs once per host (host {hosts[rank] or socket.gethostname()}: "
                      f"{rank_label(here, brackets=False)})", flush=True)
                done = {"rank": rank, "error": "", "exit_code": None}
                try:
                    command()
                except BaseException as e:
                    done["error"] = f"{type(e).__name__}: {e}"
                    raise
                finally:
                    done["exit_code"] = ns.get("_exit_code")
                    _write(key + ".json", done)
                    _settle()
                return
        finally:
            os.close(fd)  # the lock goes with it
        _settle()
        if done.get("exit_code") is not None:
            ns["_exit_code"] = done["exit_code"]
        if done["error"]:
            raise HostOnceError(f"%{name} failed on rank {done['rank']}, which ran it for this host: {done['error']}")


def _settle() -> None:
    """Imports on this rank see what was just installed."""
    importlib.invalidate_caches()


def _claim(key: str, patience: float) -> int:
    """A descriptor of ``key``'s lock file.  The first rank to claim it (after ``patience``
    seconds of waiting for another to) creates it already locked, so no other rank can take
    the lock before it: a file locked under a temporary name, then linked into place."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline and not os.path.exists(key + ".lock"):
        time.sleep(POLL_S)
    tmp = f"{key}.{os.getpid()}.claim"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(tmp, key + ".lock")
        return fd
    except FileExistsError:  # another rank claimed it first: wait at its lock
        os.close(fd)
        return os.open(key + ".lock", os.O_RDWR)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _write(path: str, value: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _private_folder(path: str) -> str:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private folder of this user; the ranks of a host meet there "
                              "to run %pip once: remove it")
    return path
