"""Rich output (figures, HTML, displays) from several ranks of one ``%%mesh`` cell: one
display laid out as a grid under the rank labels when JupyterLab's Mesh panel is connected
(its renderer draws ``GRID_MIME``), and today's text otherwise (a ``[rank N]`` line, then
that rank's display), so nbclient and ``jupyter console`` see exactly what they always did.
Runs in the kernel.
"""

from __future__ import annotations

from IPython.core.display_functions import publish_display_data

GRID_MIME = "application/vnd.monarch-kernel.rank-grid+json"


def grid_bundle(displays: list[tuple[int, dict, dict]]) -> dict:
    """One mime bundle holding every rank's displays, with a text/plain of them all."""
    items = [{"rank": r, "data": data, "metadata": md} for r, data, md in displays]
    text = "\n".join(f"[rank {r}] {data.get('text/plain', '')}" for r, data, _md in displays)
    return {GRID_MIME: {"version": 1, "items": items}, "text/plain": text}


def show_displays(session, displays: list[tuple[int, dict, dict]]) -> None:
    """Publish what the ranks displayed, ``(rank, data, metadata)`` in rank order."""
    panel = getattr(session, "panel", None)
    ranks = sorted({r for r, _d, _m in displays})
    if panel is not None and panel.connected and len(ranks) > 1:
        publish_display_data(grid_bundle(displays), {"monarch_kernel": {"ranks": ranks}})
        return
    for r, data, md in displays:
        print(f"[rank {r}]", flush=True)
        publish_display_data(data, {**md, "monarch_kernel": {"rank": r}})
