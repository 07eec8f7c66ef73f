"""The console actor: one persistent namespace per rank, in which ``%%mesh`` cells run, with
the rank's IPython shell around it (``shell.py``: ``!cmd``, magics, ``x?``, ``%debug``).

A cell's last expression is evaluated and its repr returned, as IPython does; rich output
is collected (``display.py``) and returned for the notebook to show under the rank's label.
After each cell the rank writes a sync marker with the cell's random token to its stdout and
stderr file descriptors, each in one write, so the controller knows everything the cell wrote
has reached it before the cell ends (``kernel/rank_text.py`` takes the markers out).  A rank
has no keyboard: ``input()`` fails at once, saying so.  Runs on ranks, on the rank's main
thread, so the stop button's SIGINT cuts blocking calls short.
"""

from __future__ import annotations

import bdb
import io
import logging
import os
import sys

from IPython.core.error import UsageError

from ..actor.actor import Actor
from ..actor.endpoint import endpoint
from ..debug.rank import pdb_rank, rank_debugpy
from ..runtime import SYNC_MARK, Runtime
from . import host_once
from .cells import LAST, compile_cell, remember_source
from .display import DisplayCapture
from .shell import rank_shell

log = logging.getLogger("monarch_kernel")

SYNC = SYNC_MARK  # + the cell's token + "\n": the marker a rank writes after each cell


class NoKeyboard(EOFError):
    """``input()`` (or a read of ``sys.stdin``) on a rank: the notebook cannot answer it."""


class RankStdin(io.TextIOBase):
    """A rank's ``sys.stdin``: reading it fails at once with a message that says what to do
    instead, not after a wait, and not with a bare EOFError.  (An EOFError still, so code that
    reads until the end of its input stops as it would at an empty one.)"""

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        raise NoKeyboard("input() on a rank: a %%mesh cell runs on every rank at once and nobody can type into "
                         "them; read the value in a plain cell and send it along (`%mesh push name=value` or "
                         "an argument), or run this cell on the controller")

    readline = read  # type: ignore[assignment]

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a rank's stdin has no file descriptor")


class Console(Actor):
    runs_on_main_thread = True  # the stop button then interrupts blocking calls at once

    def __init__(self):
        self.capture = DisplayCapture()
        self.shell = rank_shell({"__name__": "__mesh__", "__builtins__": __builtins__}, self.capture.add)
        self.ns: dict = self.shell.user_ns
        self.packages = host_once.HostOnce(Runtime.current().rundir)
        self.packages.install(self.shell)  # %pip and %conda: once per host
        sys.stdin = RankStdin()
        rank_debugpy.share_namespace(self.ns)
        pdb_rank.install()

    @endpoint
    def run(self, code: str, filename: str, token: str, opts: dict | None = None) -> dict:
        """Run ``code``: ``{"value": repr of its last expression or None, "displays": [...]}``.

        ``opts``: ``cell`` (the whole cell as shown), ``line_offset`` (lines of the cell
        before ``code``), ``pdb_port`` and ``post_mortem`` (distributed pdb settings).
        """
        opts = opts or {}
        cell = opts.get("cell", code)
        pdb_rank.configure(opts.get("pdb_port"), opts.get("post_mortem"))
        pdb_rank.config.cell_files.add(filename)
        remember_source(filename, cell)
        if rank_debugpy.started() is not None:
            try:
                rank_debugpy.write_source(filename, cell)
            except OSError as e:  # the cell folder is not this user's alone: run the cell, show no source
                log.warning("monarch_kernel: the debugger will not show this cell's source: %s", e)
        self.capture.clear()
        self.packages.cell_starts(token)
        shell = self.shell
        cell_result = shell.cell_starts(code)
        try:
            compiled, shows = compile_cell(code, filename, opts.get("line_offset", 0), shell.transform_cell,
                                           shell.magic_line(code))
            exec(compiled, self.ns)
            value = None
            if shows:
                result = self.ns.pop(LAST, None)
                if result is not None:
                    shell.cell_shows(cell_result, result)
                    value = repr(result)
            shell.cell_ends(cell_result)
            return {"value": value, "displays": self.capture.take()}
        except BaseException as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code is sys._getframe().f_code:
                tb = tb.tb_next  # start at the cell, not here
            if isinstance(e, UsageError) and tb is not None:
                tb.tb_next = None  # a magic used wrongly: the cell's line and the message, as IPython shows it
            shell.cell_ends(cell_result, e.with_traceback(tb) if tb is not None else e)
            if ((pdb_rank.config.post_mortem or shell.call_pdb) and tb is not None
                    and not isinstance(e, (KeyboardInterrupt, bdb.BdbQuit, SyntaxError))):
                pdb_rank.post_mortem(tb, e)
            raise
        finally:
            for stream in (sys.__stdout__, sys.__stderr__, sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError):  # a stream the cell closed or replaced
                    pass
            marker = (SYNC + token + "\n").encode()
            for fd in (1, 2):  # one write each: a pipe never interleaves it with another writer's
                try:
                    os.write(fd, marker)
                except OSError:  # the cell closed it: the kernel stops waiting after 5 s
                    pass

    @endpoint
    def debug_start(self) -> str:
        """Start debugpy here (its ident); runs on the console's own thread so cells are traced."""
        return rank_debugpy.start()

    @endpoint
    async def debug_setup(self, pdb_port=None, post_mortem: bool | None = None) -> None:
        """Where this rank's pdb sessions report, and whether errors stop in pdb."""
        pdb_rank.configure(pdb_port, post_mortem)

    @endpoint
    def push(self, values: dict) -> None:
        self.ns.update(values)

    @endpoint
    def pull(self, name: str):
        try:
            return self.ns[name]
        except KeyError:
            raise NameError(f"name {name!r} is not defined on this rank") from None
