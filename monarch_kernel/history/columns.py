"""The history's views and their columns, declared once: the writer's Parquet schemas, the
query side's empty views and the documentation all come from here.  Plain data; pyarrow is
imported only by ``schema()``, when a host first writes."""

from __future__ import annotations

# view -> [(column, SQL type, meaning)]; every view starts with time, mesh, run, host, rank.
_COMMON = [
    ("time", "TIMESTAMPTZ", "when (UTC, microseconds): printed, happened, measured"),
    ("mesh", "VARCHAR", "the mesh's (or job's) name"),
    ("run", "VARCHAR", "the run: one spawn of the mesh, named by its UTC start and a random "
                       "(`20261204T031500.123Z-9f2c1a`; `legacy`: written before runs)"),
    ("host", "VARCHAR", "the host the rank ran on"),
    ("rank", "INTEGER", "the rank (NULL for what concerns the whole mesh)"),
]
VIEWS: dict[str, list[tuple[str, str, str]]] = {
    "lines": _COMMON + [
        ("stream", "VARCHAR", "`stdout` or `stderr`"),
        ("cell", "VARCHAR", "the cell or call the line belongs to (`%%mesh` cells: `cell 7`), else NULL"),
        ("line", "VARCHAR", "the line, without its newline"),
    ],
    "events": _COMMON + [
        ("kind", "VARCHAR", "`spawn`, `exit`, `stop`, `restart`, `interrupt`, `debugger_stop`, `debugger_continue`, "
                            "`watchdog`, `history_dropped`..."),
        ("code", "INTEGER", "an exit's code, else NULL"),
        ("signal", "INTEGER", "the signal that ended a rank, else NULL"),
        ("detail", "VARCHAR", "what else is known, as text (a death's last stderr lines, the files dropped)"),
    ],
    "metrics": _COMMON + [
        ("name", "VARCHAR", "the metric's name, as given to `monarch_kernel.metric`"),
        ("step", "BIGINT", "the step given, else NULL"),
        ("value", "DOUBLE", "the value"),
    ],
    "samples": _COMMON + [
        ("pid", "INTEGER", "the rank's process"),
        ("cpu", "DOUBLE", "CPU % of one core since the previous sample (NULL for the first)"),
        ("rss_mib", "DOUBLE", "resident memory, MiB"),
        ("gpu", "DOUBLE", "utilisation % of the rank's GPU, NULL without one"),
        ("gpu_mib", "DOUBLE", "GPU memory used, MiB, NULL without one"),
    ],
    "stacks": _COMMON + [
        ("reason", "VARCHAR", "why the stacks were taken (`watchdog`, `stacks`)"),
        ("stack", "VARCHAR", "the dump, as text"),
    ],
}
# The columns a row of each view carries, in order: the writer adds ``mesh`` (a file holds one
# mesh's rows) and, for lines and metrics, ``host`` (the writer's own); ``run`` is no file's:
# a query takes it from the run's folder (so the layout before runs reads as well).
CONSTANT_HOST = frozenset({"lines", "metrics"})
FROM_FOLDER = frozenset({"run"})


def row_columns(view: str) -> list[str]:
    skip = {"mesh"} | FROM_FOLDER | ({"host"} if view in CONSTANT_HOST else set())
    return [name for name, _t, _d in VIEWS[view] if name not in skip]


_ARROW = {"VARCHAR": "string", "INTEGER": "int32", "BIGINT": "int64", "DOUBLE": "float64"}


def schema(view: str):
    """The pyarrow schema of ``view``'s files."""
    import pyarrow as pa

    fields = []
    for name, sql, _doc in VIEWS[view]:
        if name in FROM_FOLDER:
            continue
        typ = pa.timestamp("us", tz="UTC") if sql == "TIMESTAMPTZ" else getattr(pa, _ARROW[sql])()
        fields.append(pa.field(name, typ))
    return pa.schema(fields)


def empty_select(view: str) -> str:
    """SQL for ``view`` with no rows, its columns typed: what a view with no files yet reads."""
    cols = ", ".join(f"CAST(NULL AS {sql}) AS {name}" for name, sql, _doc in VIEWS[view])
    return f"SELECT {cols} WHERE false"


def markdown() -> str:
    """The views and their columns as Markdown tables (the docs page's)."""
    out = []
    for view, cols in VIEWS.items():
        out += [f"`{view}`", "", "| column | type | meaning |", "|---|---|---|"]
        out += [f"| `{n}` | {t} | {d} |" for n, t, d in cols]
        out.append("")
    return "\n".join(out)
