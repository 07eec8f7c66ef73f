"""Plain records of what went wrong on a rank; the exceptions that carry them to the caller
are in ``errors.py``.

They are pickled across processes, so they hold only builtins, strings and (when it pickles)
the original exception.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import traceback
from dataclasses import dataclass, field

from . import cuda_oom


@dataclass
class RemoteFailure:
    """An endpoint (or an actor's ``__init__``) raised on a rank."""

    rank: int
    actor: str
    method: str
    type_name: str
    message: str
    traceback: str
    host: str
    pid: int
    exc_bytes: bytes | None = None  # the exception itself, when it pickles

    @classmethod
    def capture(cls, rank: int, actor: str, method: str, exc: BaseException, frames_to_skip=1):
        tb = exc.__traceback__
        for _ in range(frames_to_skip):
            if tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
        memory = cuda_oom.note(exc)  # a CUDA OOM says how full the GPU was
        add_note = getattr(exc, "add_note", None)  # Python 3.11+: tracebacks print the note
        if memory and add_note is not None and memory not in getattr(exc, "__notes__", ()):
            add_note(memory)
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        try:
            exc_bytes = pickle.dumps(exc.with_traceback(None))
            pickle.loads(exc_bytes)
        except Exception:
            exc_bytes = None
        message = f"{exc}\n{memory}" if memory else str(exc)
        return cls(rank, actor, method, type(exc).__qualname__, message, text,
                   socket.gethostname(), os.getpid(), exc_bytes)

    def exception(self) -> BaseException | None:
        if self.exc_bytes is None:
            return None
        try:
            return pickle.loads(self.exc_bytes)
        except Exception:
            return None


@dataclass
class DeathInfo:
    """A rank's process ended: how, where, and the last lines it wrote to stderr."""

    mesh: str  # the mesh's name
    rank: int
    pid: int
    host: str
    exitcode: int | None = None
    signal: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    stopped: bool = False  # ended by stop(), not by a failure
    oom: str = ""  # killed by the out-of-memory killer: what it held and the limit ("it held 2 GiB; ...")

    @classmethod
    def from_status(cls, mesh, rank, pid, host, status: int, tail):
        if os.WIFSIGNALED(status):
            return cls(mesh, rank, pid, host, None, os.WTERMSIG(status), list(tail))
        return cls(mesh, rank, pid, host, os.WEXITSTATUS(status), None, list(tail))

    def how(self) -> str:
        if self.oom:
            return f"killed by the out-of-memory killer ({self.oom})"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by signal {self.signal} ({name})"
        if self.exitcode is None:
            return "lost (no exit status)"
        return f"exited with code {self.exitcode}"

    def describe(self) -> str:
        if self.oom:  # the cause first: it is what the reader needs
            s = (f"rank {self.rank} was {self.how()}: mesh '{self.mesh}', pid {self.pid} on {self.host}, "
                 f"signal {self.signal} (SIGKILL)")
            return s + self._tail()
        s = f"rank {self.rank} of mesh '{self.mesh}' (pid {self.pid} on {self.host}) {self.how()}"
        return s + self._tail()

    def cause(self) -> str:
        """Why the actors on this rank failed, in the words of Monarch's report (``the
        process this actor was running on failed: Killed(sig=9)``), then where it was."""
        where = f"rank {self.rank} of mesh '{self.mesh}', pid {self.pid} on {self.host}"
        if self.oom:
            how = f"was {self.how()} ({where})"
        elif self.signal is not None:
            how = f"failed: Killed(sig={self.signal}) ({self.how().partition('(')[2].rstrip(')')}; {where})"
        elif self.exitcode is None:
            how = f"was lost, with no exit status ({where})"
        else:
            how = f"exited with {'non-zero ' if self.exitcode else ''}code {self.exitcode} ({where})"
        return f"the process this actor was running on {how}" + self._tail()

    def _tail(self) -> str:
        if not self.stderr_tail:
            return ""
        return "\nlast lines of its stderr:\n" + "\n".join("    " + line for line in self.stderr_tail)


@dataclass
class MeshFailure:
    """A supervision event: something failed on a mesh and nobody was waiting for it.

    Example::

        class Trainer(Actor):
            def __supervise__(self, failure: MeshFailure) -> bool:
                print(failure.mesh, failure.rank)
                return True                     # handled: not the fault hook's
    """

    mesh: str
    rank: int
    text: str  # human-readable, names mesh, rank, host and cause
    death: DeathInfo | None = None
    remote: RemoteFailure | None = None
    chain: list[str] = field(default_factory=list)  # supervisors that did not handle it (their paths)
    actor: str = ""  # the failed actor's path, ``<root>.<mod.Cls name{point}>`` (a death: one hosted there)

    def report(self) -> str:
        """What failed, where and why, with the supervisors that passed it on (a method,
        as in Monarch, and worded as Monarch's when an actor failed)."""
        s = self.text
        if self.actor:
            body = "\n".join("  " + line if line else line for line in s.splitlines())
            s = f"The actor {self.actor} and all its descendants have failed:\n{body}"
        for c in self.chain:
            s += f"\n  (not handled by {c})"
        return s

    def __str__(self) -> str:
        # Monarch's form, which its users print and match on; the report is its event.
        return f"MeshFailure(mesh_name={self.mesh}, crashed_ranks=[{self.rank}], event={self.report()})"
