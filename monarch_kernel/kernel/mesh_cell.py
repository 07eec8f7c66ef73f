"""Running a ``%%mesh`` cell: check its syntax here, send it to the ranks' consoles, stream
their output into the cell under a progress line that ticks each second, show each rank's
value and display and each failure once (``cell_errors.py``), and turn the stop button into
an interrupt of the ranks.  Runs in the kernel (any IPython shell with the magics).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from .. import history
from ..actor.adverbs import sends_total
from ..actor.errors import ActorError, HangError
from ..debug.controller import proxy
from ..runtime import RankSpecError, config, counted, parse_ranks, rank_label
from .cell_errors import MeshCellError, MeshCellInterrupted, cell_label, check_syntax
from .panel.grid import show_displays

if TYPE_CHECKING:
    from .session import MeshSession

INTERRUPT_GRACE_S = config.seconds("interrupt_grace")
PROGRESS_AFTER_S = config.seconds("progress_after")
OUTPUT_QUIET_S = config.seconds("output_quiet")


def ranks_arg(spec: str, n: int, flag: str) -> list[int]:
    """``parse_ranks`` for a magic's argument: a bad spec is a ``UsageError``."""
    try:
        return parse_ranks(spec, n)
    except RankSpecError as e:
        raise UsageError(f"{flag} {e}") from None


def run_on_mesh(session: MeshSession, cell: str, ranks_spec: str | None, timeout: float | None,
                stream: bool = True, by_rank: bool = False, line: str = ""):
    procs, consoles = session.get()
    n = len(procs)
    ranks = ranks_arg(ranks_spec, n, "--ranks") if ranks_spec else list(range(n))
    target = consoles if len(ranks) == n else _select(consoles, ranks)
    token = uuid.uuid4().hex
    whole, filename, offset = check_cell(session, cell, line)
    session.sink.hold = not stream
    opts = {"cell": whole, "line_offset": offset, **session.pdb.cell_options()}
    session.sink.expect(token)
    history.set_cell(cell_label(filename) or filename)  # what the ranks print now belongs to this cell
    sent_before = sends_total()
    fut = target.run.call(cell, filename, token, opts)
    interrupted = False
    session.pdb.cell_running = True
    try:
        try:
            results = _wait_with_progress(fut, session.sink, token, len(ranks), timeout, session.pdb)
            session.pdb.announce()
        except KeyboardInterrupt:
            # The stop button: interrupt the ranks' code, keep their namespaces.
            interrupted = True
            history.record_event(procs.name, "interrupt", detail=f"ranks {rank_label(ranks)}")
            try:
                with _stops_deferred():  # a second click is no traceback from inside a send
                    # A rank held at a breakpoint is interrupted through its inspector (debugpy
                    # holds its IO loop too), then resumed so the interrupt lands on the line
                    # it stopped at.
                    held = proxy.stopped_rank(session.shell, procs.name, ranks)
                    procs.interrupt(consoles, [r for r in ranks if r != held], wait=2.0)
                    proxy.release_for_interrupt(session.shell, procs.name, ranks, consoles.actor_id)
                    results = fut.get(timeout=INTERRUPT_GRACE_S)
            except TimeoutError:
                session.sink.flush(end=True)
                late = (f"; some did not stop within {INTERRUPT_GRACE_S:g} s and may still run "
                        "(%mesh stacks shows where)")
                raise MeshCellInterrupted.of(ranks, {}, filename, late) from None
        failed = None
    except (TimeoutError, HangError):  # --timeout, or the hang watchdog's abort: the cell ends here
        session.sink.flush(end=True)
        session.sink.hold = False
        raise
    except ActorError as e:
        results, failed = getattr(e, "results", None), e
    finally:
        session.pdb.cell_running = False
    mesh_name = procs.name
    dead = set(procs.dead_ranks())
    expected = {(mesh_name, r, s) for r in ranks for s in ("stdout", "stderr") if r not in dead}
    if session.sink.wait_synced(token, expected, OUTPUT_QUIET_S, by_rank) and not dead & set(ranks):
        session.output_synced(sent_before)
    session.sink.hold = False
    errors = {}
    if results is not None:
        shown: dict[str, list[int]] = {}  # the same value from several ranks prints once
        displays: list[tuple[int, dict, dict]] = []
        for (_point, value), r in zip(results.items(), ranks, strict=True):
            if isinstance(value, BaseException):
                errors[r] = value
                continue
            if value["value"] is not None:
                shown.setdefault(value["value"], []).append(r)
            displays.extend((r, data, md) for data, md in value["displays"])
        session.shell.user_ns["_mesh"] = results.__class__(
            results.shape, [v if isinstance(v, BaseException) else v["value"] for v in results.values()])
        show_displays(session, displays)  # a grid where the Mesh panel draws one, else [rank N] then each
        for value, rs in shown.items():
            print(f"{rank_label(rs)} {value}")
    if interrupted:
        raise MeshCellInterrupted.of(ranks, errors, filename)
    if failed is not None:
        raise MeshCellError.of(errors or {ranks[0]: failed}, filename)
    return None


@contextlib.contextmanager
def _stops_deferred():
    """While the ranks are being interrupted, a further SIGINT (the stop button again) is
    dropped instead of raising inside a message half sent: the cell is stopping already, and
    ends within ``interrupt_grace`` either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def check_cell(session: MeshSession, cell: str, line: str = "") -> tuple[str, str, int]:
    """``session.cell_file``, after checking the cell's syntax here: a syntax error shows once,
    and never reaches the ranks."""
    whole, filename, offset = session.cell_file(line, cell)
    check_syntax(cell, filename, offset, cell_label(filename) or "")
    return whole, filename, offset


def _wait_with_progress(fut, sink, token: str, n: int, timeout: float | None, pdb=None):
    """``fut.get(timeout)``, showing "k of n ranks finished (3 s)" once the cell runs past 2 s,
    as the cell's last line (the sink's tail: it stays below the ranks' lines and goes when the
    cell ends, unless the cell showed nothing else), and serving ranks that stop in pdb
    meanwhile."""
    start = time.monotonic()
    shown = None
    try:
        while True:
            if pdb is not None and pdb.waiting():
                sink.flush()
                pdb.serve(done=fut.done, auto_attach=n == 1)
            elapsed = time.monotonic() - start
            step = 0.25 if timeout is None else max(0.0, min(0.25, timeout - elapsed))
            try:
                return fut.get(timeout=step)
            except TimeoutError:
                if timeout is not None and time.monotonic() - start >= timeout:
                    raise TimeoutError(f"the cell did not finish on every rank within {timeout:g} s "
                                       "(it is still running there; interrupt the kernel to stop it)") from None
            elapsed = time.monotonic() - start
            if elapsed < PROGRESS_AFTER_S:
                continue
            now = (sink.finished(token), int(elapsed))
            if now != shown:
                sink.progress(_progress(n, *now))
            shown = now
    finally:
        if shown is not None:
            done = n if fut.done() else sink.finished(token)  # the markers may still be on their way
            sink.progress(_progress(n, done, int(time.monotonic() - start)), final=True)


def _progress(n: int, finished: int, seconds: int) -> str:
    return f"[mesh] {finished} of {counted(n, 'rank')} finished ({seconds} s)"


def _select(consoles, ranks):
    """The console actors of the given ranks, as one mesh (contiguous or stepped); ranks are
    counted across every dim (a job's mesh is {"hosts": H, "ranks": n})."""
    if list(consoles.extent) != ["ranks"]:
        consoles = consoles.flatten("ranks")
    if len(ranks) == 1:
        return consoles.slice(ranks=ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and ranks == list(range(ranks[0], ranks[-1] + 1, step)):
        return consoles.slice(ranks=slice(ranks[0], ranks[-1] + 1, step))
    raise UsageError(f"--ranks selects {ranks}: use a range (0-3), a stride (::2) or a single rank")
