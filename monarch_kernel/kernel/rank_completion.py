"""Tab and Shift-Tab in a ``%%mesh`` cell (and in every cell under ``%mesh auto on``) answered
from the ranks' namespace: the first rank of ``--ranks`` (rank 0 by default) completes and
inspects with its own IPython shell (``console/completer.py``).

A rank that is slow or busy must never hold the notebook's completer: past ``ANSWER_S`` the
kernel answers from its own namespace and says so in the reply's metadata.  Runs in the kernel.
"""

from __future__ import annotations

from IPython.core.error import UsageError

from ..actor.errors import ActorError
from ..console.completer import Completer
from ..runtime import RankSpecError, config, parse_ranks
from .magic_args import cell_args, parse

ANSWER_S = config.seconds("rank_complete")  # a Tab waits this long for a rank, then the kernel's namespace answers
KEY = "monarch_kernel"  # the reply metadata's key that says who answered


class RankCompletion:
    """Asks a rank of the current mesh to complete or inspect a mesh cell."""

    def __init__(self, session):
        self.session = session  # MeshSession: the meshes, which one is current, auto mode
        self._completers: dict[str, tuple] = {}  # mesh name -> (its ProcMesh, Completer mesh over flat ranks)

    def complete(self, code: str, cursor_pos: int) -> dict | str | None:
        """The rank's ``complete_reply`` content (code positions as the notebook sent them);
        a string saying why no rank answered a mesh cell; None for a cell of the kernel's own."""
        return self._ask("complete", code, cursor_pos)

    def inspect(self, code: str, cursor_pos: int, detail_level: int, omit_sections) -> dict | str | None:
        """As ``complete``, for an ``inspect_reply``."""
        return self._ask("inspect", code, cursor_pos, detail_level, list(omit_sections))

    def _ask(self, what: str, code: str, cursor_pos: int, *args) -> dict | str | None:
        target = self.rank_view(code, cursor_pos)
        if target is None:
            return None
        body, cursor, line, start = target
        try:
            procs, _consoles = self.session.get()
        except UsageError:
            return "no mesh to ask (start one with  %mesh spawn)"
        rank = _first_rank(line, len(procs))
        one = self._completer(procs).slice(ranks=rank)
        try:
            reply = getattr(one, what).call_one(body, cursor, *args).get(timeout=ANSWER_S)
        except TimeoutError:
            return f"rank {rank} did not answer within {ANSWER_S * 1000:.0f} ms (busy, or slow)"
        except ActorError as e:
            self._completers.pop(procs.name, None)  # a restarted rank needs a new completer
            return f"rank {rank} could not answer: {type(e.__cause__ or e).__name__}"
        if what == "complete":  # the rank's positions count from the cell body it saw
            reply["cursor_start"] += start
            reply["cursor_end"] += start
            for kind in reply["metadata"].get("_jupyter_types_experimental", []):
                kind["start"] += start
                kind["end"] += start
        reply["metadata"][KEY] = {"answered_by": f"rank {rank}", "mesh": procs.name}
        return reply

    def rank_view(self, code: str, cursor_pos: int) -> tuple[str, int, str, int] | None:
        """``(code as the rank runs it, cursor there, the %%mesh line's arguments, offset of
        that code in the cell)``; None when the kernel answers (not a mesh cell, or the cursor
        is on its ``%%mesh`` line)."""
        stripped = code.lstrip()
        if stripped.startswith("%%mesh"):
            lead = len(code) - len(stripped)
            newline = code.find("\n", lead)
            if newline < 0 or cursor_pos <= newline:
                return None
            start = newline + 1
            return code[start:], cursor_pos - start, code[lead + len("%%mesh"):newline], start
        if self.session.auto and not stripped.startswith("%mesh"):
            return code, cursor_pos, "", 0
        return None

    def _completer(self, procs):
        known = self._completers.get(procs.name)
        if known is not None and known[0] is procs:
            return known[1]
        mesh = procs.spawn("completer", Completer)  # at once; the first call waits behind its __init__
        if list(mesh.extent) != ["ranks"]:
            mesh = mesh.flatten("ranks")  # ranks counted across every dim (a job's mesh has hosts too)
        self._completers[procs.name] = (procs, mesh)
        return mesh


def _first_rank(line: str, n: int) -> int:
    """The first rank of the ``%%mesh`` line's ``--ranks`` on a mesh of ``n`` (0 without one,
    or with a wrong one: running the cell says what is wrong with it)."""
    try:
        spec = parse(cell_args, line).ranks
        return parse_ranks(spec, n)[0] if spec else 0
    except (UsageError, RankSpecError, IndexError):
        return 0
