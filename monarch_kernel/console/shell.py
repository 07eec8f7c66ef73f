"""The IPython shell of a rank, so that a ``%%mesh`` cell takes what an IPython cell takes:
``!cmd``, line and cell magics, ``x?``, ``get_ipython()``, ``_``, ``Out`` and ``%debug``.

The console still compiles and runs each cell itself, as one code object under the cell's
own line numbers (tracebacks and debuggers see the cell, stepping reaches every line); the
shell only turns IPython syntax into Python and keeps IPython's state and events around it.
Runs on ranks; importing it creates nothing (``rank_shell`` does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from IPython.core.prefilter import is_shadowed
from traitlets import Type
from traitlets.config import Config

from ..debug.rank import pdb_rank
from ..runtime import config

CHILD_GRACE_S = config.seconds("shell_command_grace")  # a ``!cmd`` the stop button interrupts: to end on SIGINT


class RankPublisher(DisplayPublisher):
    """``display()`` on a rank: each bundle goes to ``sink`` (the console's capture), which
    hands it to the notebook, under the rank's label, when the cell ends."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sink = None

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs) -> None:
        if self.sink is not None:
            self.sink(dict(data), dict(metadata or {}))

    def clear_output(self, wait: bool = False) -> None:
        pass  # a rank's displays are shown once, when its cell ends: nothing shown yet to clear


class RankShell(InteractiveShell):
    """An ``InteractiveShell`` that lives in a rank process it does not own."""

    # A traitlets Type, as InteractiveShell declares it; its stubs type the base's value as a plain class.
    display_pub_class = Type(RankPublisher)  # type: ignore[assignment]

    def init_sys_modules(self) -> None:
        # IPython puts its namespace in ``sys.modules`` under its ``__name__``; ours stays out,
        # so classes defined in a cell still travel by value to the notebook and other ranks.
        pass

    def init_virtualenv(self) -> None:
        pass  # the rank runs in the interpreter it was started with: nothing to add to sys.path

    def enable_gui(self, gui=None) -> None:
        if gui not in (None, "inline"):
            raise UsageError(f"a rank has no screen for a {gui} window; use  %matplotlib inline  "
                             "(figures show in the cell)")

    def system(self, cmd: str) -> None:
        """``!cmd``: run in the rank's shell with the rank's own stdout and stderr, so its lines
        stream into the cell as the rank's prints do (stderr stays stderr).  The stop button
        interrupts the command's whole process group, then ends the cell."""
        cmd = self.var_expand(cmd, depth=1)  # {name} and $name from the cell's frame
        sys.stdout.flush()
        sys.stderr.flush()
        # Its own process group, so an interrupt reaches what the shell started (``sleep`` in
        # ``!echo; sleep 60``); if the rank dies first, the template ends the orphaned group.
        proc = subprocess.Popen(cmd, shell=True, executable=os.environ.get("SHELL"), stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)  # and whatever it left behind
            proc.wait()
            raise
        self.user_ns["_exit_code"] = code

    system_piped = system_raw = system

    def debugger(self, force: bool = False) -> None:
        """``%debug`` (and ``%pdb on``): stop in the mesh's pdb, at the last error of this rank."""
        if not (force or self.call_pdb):
            return
        error = getattr(sys, "last_value", None)
        tb = getattr(sys, "last_traceback", None)
        if error is None or tb is None:
            print("%debug: no error on this rank yet, so nothing to debug; run it after a cell that failed here")
            return
        why = pdb_rank.post_mortem(tb, error, force=True)
        if why:
            print(f"%debug: cannot stop here: {why}")

    def magic_line(self, cell: str) -> bool:
        """Whether IPython reads this one-line cell as a magic without its ``%`` (``cd /tmp``,
        ``pwd``) though it parses as Python: automagic, not shadowed by a name."""
        text = cell.strip()
        if not text or "\n" in text or not self.automagic:
            return False
        word = text.split(None, 1)[0]
        return self.find_magic(word) is not None and not is_shadowed(word.split(".", 1)[0], self)

    # -- around each cell the console runs (what IPython's own run_cell does around its code)

    def cell_starts(self, raw_cell: str) -> ExecutionResult:
        """Count the cell, keep it in ``In``/``_i`` and tell the extensions it starts."""
        info = ExecutionInfo(raw_cell, True, False, True, None)
        result = ExecutionResult(info)
        result.execution_count = self.execution_count
        self.execution_count += 1
        self.events.trigger("pre_execute")
        self.events.trigger("pre_run_cell", info)
        assert self.history_manager is not None  # made in __init__
        self.history_manager.store_inputs(result.execution_count, raw_cell, raw_cell)
        return result

    def cell_shows(self, result: ExecutionResult, value) -> None:
        """The cell's last value: ``_``, ``__``, ``___``, ``_N`` and ``Out[N]`` as IPython keeps them."""
        result.result = value
        self.displayhook.update_user_ns(value)

    def cell_ends(self, result: ExecutionResult, error: BaseException | None = None) -> None:
        """Remember a failure for ``%debug`` (from the cell's frame on: ``tb``), then tell the
        extensions (``%matplotlib inline`` shows its figures here)."""
        if error is not None:
            result.error_in_exec = error
            sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
            if sys.version_info >= (3, 12):
                sys.last_exc = error
        self.last_execution_succeeded = error is None
        self.last_execution_result = result
        self.events.trigger("post_execute")
        self.events.trigger("post_run_cell", result)


def rank_shell(ns: dict, display_sink) -> RankShell:
    """This rank's shell, made on first use to run cells in ``ns`` (a later console of the
    same rank shares the first one's namespace: ``shell.user_ns``); ``display()`` bundles go
    to ``display_sink``.

    History stays in memory (a database file written by every rank at once helps nobody), and
    no config files, startup files or profile extensions run: a rank is a program, not a
    person's terminal.
    """
    if InteractiveShell.initialized():
        shell = InteractiveShell.instance()
        if not isinstance(shell, RankShell):
            raise RuntimeError("this process already runs another IPython shell; a console belongs in a rank process")
        shell.display_pub.sink = display_sink
        return shell
    cfg = Config()
    cfg.HistoryManager.enabled = False
    cfg.IPCompleter.use_jedi = False  # Tab answers from ranks within 200 ms: jedi's first use alone takes longer
    shell = RankShell.instance(config=cfg, user_ns=ns)
    shell.display_pub.sink = display_sink
    shell.set_hook("show_in_pager", _pager, 99)
    return shell


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pager(shell, data, start: int = 0, screen_lines: int = 0) -> None:
    """``x?`` and ``x??``: the answer is one display of the rank's (as ipykernel shows it in one
    piece), so the same answer from many ranks shows once, under one label, not a label a line."""
    bundle = dict(data) if isinstance(data, dict) else {"text/plain": str(data)}
    if start:
        bundle["text/plain"] = "\n".join(str(bundle.get("text/plain", "")).splitlines()[start:])
    shell.display_pub.publish(bundle, {})
