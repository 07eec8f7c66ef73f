"""A mesh's history files on the hosts its agents run: fetched through the agents, over the
same signed, encrypted link as everything else a controller says to them.  The runtime moves
the bytes; what the files are is the history package's."""

from __future__ import annotations

from ..completion import Completion
from . import host_messages as hw


def fetch(rt, links: list, mesh: str, have: list[str]) -> Completion:
    """From any thread: ``{host folder: [(name, bytes)], ...}`` of the history files of ``mesh``
    that ``links`` (agents, ``AgentLink``) hold and ``have`` does not name, and the errors
    as ``{"": [(host, why)]}`` entries."""
    got = Completion()
    out: dict[str, list[tuple[str, bytes]]] = {}
    waiting = {id(link) for link in links}

    def go() -> None:
        if not waiting:
            got.set_result(out)
            return
        for key, link in {id(link): link for link in links}.items():
            def heard(msg: hw.HistoryFile, key=key, host=link.host) -> None:
                if msg.name:
                    out.setdefault(msg.host, []).append((msg.name, msg.data))
                if msg.error:
                    out.setdefault("", []).append((host, msg.error.encode()))
                if msg.last:
                    waiting.discard(key)
                    if not waiting and not got.done():
                        got.set_result(out)
            link.history(mesh, have, heard)

    rt.io.call_soon(go)
    return got
