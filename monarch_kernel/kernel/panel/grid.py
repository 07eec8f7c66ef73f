"""Rich output (figures, HTML, displays) from several ranks of one ``%%mesh`` cell: one
display laid out as a grid under the rank labels when JupyterLab's Mesh panel is connected
(its renderer draws ``GRID_MIME``), and today's text otherwise (a ``[rank N]`` line, then
that rank's display), so nbclient and ``jupyter console`` see exactly what they always did.
Ranks that displayed the very same (``x?``'s answer, one figure drawn alike) show it once,
under one label, as the same line from several ranks does.  Runs in the kernel.
"""

from __future__ import annotations

import json

from IPython.core.display_functions import publish_display_data

from ...runtime import rank_label

GRID_MIME = "application/vnd.monarch-kernel.rank-grid+json"


def grid_bundle(displays: list[tuple[int, dict, dict]]) -> dict:
    """One mime bundle holding every rank's displays, with a text/plain of them all."""
    items = [{"rank": r, "data": data, "metadata": md} for r, data, md in displays]
    text = "\n".join(f"[rank {r}] {data.get('text/plain', '')}" for r, data, _md in displays)
    return {GRID_MIME: {"version": 1, "items": items}, "text/plain": text}


def show_displays(session, displays: list[tuple[int, dict, dict]]) -> None:
    """Publish what the ranks displayed, ``(rank, data, metadata)`` in rank order.  Ranks that
    displayed the very same (``x?``'s help on every rank) show it once, under one label."""
    panel = getattr(session, "panel", None)
    ranks = sorted({r for r, _d, _m in displays})
    same = same_displays(displays)
    if panel is not None and panel.connected and len(same) > 1:
        publish_display_data(grid_bundle(displays), {"monarch_kernel": {"ranks": ranks}})
        return
    for rs, shown in same:
        print(rank_label(rs), flush=True)
        for data, md in shown:
            publish_display_data(data, {**md, "monarch_kernel": {"rank": rs[0]} if len(rs) == 1 else {"ranks": rs}})


def same_displays(displays: list[tuple[int, dict, dict]]) -> list[tuple[list[int], list[tuple[dict, dict]]]]:
    """The ranks grouped by what they displayed, every display of a rank in its order:
    ``[(ranks, [(data, metadata), ...]), ...]``, in the order of each group's first rank."""
    by_rank: dict[int, list[tuple[dict, dict]]] = {}
    for r, data, md in displays:
        by_rank.setdefault(r, []).append((data, md))
    groups: dict[str, tuple[list[int], list[tuple[dict, dict]]]] = {}
    for r, shown in by_rank.items():
        key = json.dumps(shown, sort_keys=True, default=repr)
        groups.setdefault(key, ([], shown))[0].append(r)
    return list(groups.values())
