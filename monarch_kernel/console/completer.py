"""Tab and Shift-Tab in a ``%%mesh`` cell, answered by a rank: the ``Completer`` actor completes
and inspects names in the console's namespace with the rank's IPython shell, so a name that
exists only on the ranks is offered.

A separate actor from the console on purpose: the console takes one message at a time, and a
Tab must be answered while it runs a cell.  Runs on ranks; never waits on the console.
"""

from __future__ import annotations

import threading

from IPython.core.completer import provisionalcompleter, rectify_completions
from IPython.utils.tokenutil import token_at_cursor

from ..actor.actor import Actor
from ..actor.endpoint import endpoint
from .shell import RankShell


class Completer(Actor):
    """Answers the notebook's ``complete_request`` and ``inspect_request`` for this rank."""

    def __init__(self):
        # debugpy must never hold this thread: a rank stopped at a breakpoint still completes.
        threading.current_thread().pydev_do_not_trace = True

    @endpoint
    def complete(self, code: str, cursor_pos: int) -> dict:
        """A ``complete_reply``'s content for ``code`` (the cell as the rank runs it)."""
        shell = _shell()
        with provisionalcompleter():
            found = list(rectify_completions(code, shell.Completer.completions(code, cursor_pos)))
        start, end = (found[0].start, found[0].end) if found else (cursor_pos, cursor_pos)
        kinds = [{"start": c.start, "end": c.end, "text": c.text, "type": c.type, "signature": c.signature}
                 for c in found]
        return {"status": "ok", "matches": [c.text for c in found], "cursor_start": start, "cursor_end": end,
                "metadata": {"_jupyter_types_experimental": kinds}}

    @endpoint
    def inspect(self, code: str, cursor_pos: int, detail_level: int = 0, omit_sections=()) -> dict:
        """An ``inspect_reply``'s content: what ``name?`` (``name??`` at level 1) shows here."""
        shell = _shell()
        name = token_at_cursor(code, cursor_pos)
        try:
            data = shell.object_inspect_mime(name, detail_level=detail_level, omit_sections=set(omit_sections))
        except KeyError:
            return {"status": "ok", "found": False, "data": {}, "metadata": {}}
        if not shell.enable_html_pager:
            data.pop("text/html", None)
        return {"status": "ok", "found": True, "data": data, "metadata": {}}


def _shell() -> RankShell:
    if not RankShell.initialized():
        raise RuntimeError("this rank has no console yet: spawn the mesh with  %mesh spawn")
    return RankShell.instance()
