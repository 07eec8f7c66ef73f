"""``ProcMesh.to_table()``: which rank sits at each point of a mesh, as a text table (what
``print`` shows) that renders as an HTML table in a notebook.  Rows run over the
second-to-last dim, columns over the last; any dims before those get one table per point.
Pure text; it starts nothing.
"""

from __future__ import annotations

import html
import itertools

from .shape import Shape


class MeshTable(str):
    """The text table, a ``str``; ``_repr_html_`` is the same table in HTML."""

    _html: str

    def _repr_html_(self) -> str:
        return self._html


def mesh_table(shape: Shape, hosts: list[str] | None = None) -> MeshTable:
    """The table of ``shape``: each point's proc-mesh rank, and its host when ``hosts``
    (one per proc-mesh rank) names more than one."""
    labels, sizes = shape.extent.labels, shape.extent.sizes
    multi_host = bool(hosts) and len(set(hosts or ())) > 1

    def cell(index: int) -> str:
        r = shape.ranks[index]
        return f"{r} ({hosts[r]})" if multi_host and hosts else str(r)

    if not labels:
        t = MeshTable(cell(0))
        t._html = f"<table><tr><td>{html.escape(cell(0))}</td></tr></table>"
        return t
    cols_label, cols = labels[-1], sizes[-1]
    rows_label, rows = (labels[-2], sizes[-2]) if len(labels) > 1 else ("", 1)
    outer = list(zip(labels[:-2], sizes[:-2], strict=True))
    per_table = rows * cols
    texts, htmls = [], []
    for k, combo in enumerate(itertools.product(*(range(s) for _, s in outer))):
        title = ", ".join(f"{label}={c}" for (label, _), c in zip(outer, combo, strict=True))
        head = [""] + [f"{cols_label}={c}" for c in range(cols)] if rows_label else \
            [f"{cols_label}={c}" for c in range(cols)]
        body = []
        for r in range(rows):
            row = [cell(k * per_table + r * cols + c) for c in range(cols)]
            body.append(([f"{rows_label}={r}"] + row) if rows_label else row)
        texts.append(_text(title, head, body))
        htmls.append(_html(title, head, body, bool(rows_label)))
    t = MeshTable("\n\n".join(texts))
    t._html = "".join(htmls)
    return t


def _text(title: str, head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [title + ":"] if title else []
    for row in [head, *body]:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _html(title: str, head: list[str], body: list[list[str]], row_headers: bool) -> str:
    cap = f"<caption>{html.escape(title)}</caption>" if title else ""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    def cells(row: list[str]) -> str:
        return "".join(f"<th>{html.escape(v)}</th>" if row_headers and i == 0 else f"<td>{html.escape(v)}</td>"
                       for i, v in enumerate(row))

    trs = "".join(f"<tr>{cells(row)}</tr>" for row in body)
    return f"<table>{cap}<thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"
