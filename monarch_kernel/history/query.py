"""A history, asked in SQL: DuckDB over the Parquet files of one mesh or job (every host's
folder under it), with the views of ``columns.VIEWS``.  Reads only; never writes a history.
DuckDB and pandas load on the first query."""

from __future__ import annotations

import pathlib
from typing import Any

from . import pending, places
from .columns import VIEWS, empty_select
from .gather import gather
from .listing import HistoryRecord, list_histories
from .recorder import flush


class HistoryNotFound(LookupError):
    """No history of that name under the root."""


class History:
    """One mesh's (or job's) history: ``sql(query)`` returns a pandas DataFrame.

    Example::

        h = monarch_kernel.history("train")
        h.sql("SELECT rank, count(*) AS n FROM lines GROUP BY rank ORDER BY rank")
    """

    views = list(VIEWS)

    def __init__(self, folder: pathlib.Path, record: HistoryRecord | None = None):
        self.folder = folder
        self.name = record.name if record is not None else folder.name
        self.record = record
        self._con: Any = None

    def __repr__(self) -> str:
        return f"History({self.name!r}, {str(self.folder)!r})"

    def files(self, view: str) -> list[str]:
        return sorted(str(p) for p in self.folder.glob(f"*/{view}-*.parquet"))

    def connect(self):
        """A DuckDB connection with this history's views (made again on each call: files come
        and go as hosts write and rotate)."""
        import duckdb

        flush()  # rows this process gathered and has not written yet
        pending.wait_written(self.folder.parent)  # ... and those of a controller that just exited
        con = duckdb.connect(":memory:")
        con.execute("SET TimeZone = 'UTC'")
        for view in VIEWS:
            files = self.files(view)
            if files:
                listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
                con.execute(f"CREATE VIEW {view} AS SELECT * FROM read_parquet([{listed}], union_by_name=true)")
            else:
                con.execute(f"CREATE VIEW {view} AS {empty_select(view)}")
        return con

    def sql(self, query: str):
        """The result of ``query`` (DuckDB's SQL over the views ``lines``, ``events``, ``metrics``,
        ``samples``, ``stacks``) as a pandas DataFrame."""
        import duckdb

        for attempt in (1, 2):
            con = self.connect()
            try:
                rel = con.sql(query)
                return rel.df() if rel is not None else None
            except duckdb.IOException:
                if attempt == 2:
                    raise  # a file merged or rotated away between listing and reading: list again, once
            finally:
                con.close()
        return None

    def plot(self, name: str, ax=None):
        """Each rank's metric ``name`` over steps (or time, without steps), with matplotlib;
        the Axes."""
        df = self.sql("SELECT rank, coalesce(CAST(step AS DOUBLE), epoch(time)) AS x, value FROM metrics "
                      f"WHERE name = '{name.replace(chr(39), chr(39) * 2)}' ORDER BY rank, x")
        if df.empty:
            known = ", ".join(self.sql("SELECT DISTINCT name FROM metrics ORDER BY 1")["name"]) or "none"
            raise LookupError(f"no metric {name!r} in the history of {self.name!r}; its metrics: {known}")
        import matplotlib.pyplot as plt

        if ax is None:
            _fig, ax = plt.subplots(figsize=(7, 3.5))
        for rank, part in df.groupby("rank", dropna=False):
            ax.plot(part["x"], part["value"], label=f"rank {rank}" if rank == rank else "controller")
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.set_title(f"{name} on {self.name}")
        if df["rank"].nunique() <= 16:
            ax.legend(fontsize="small")
        return ax


def open_history(name_or_mesh=None, *, root=None) -> History:
    """The history of mesh or job ``name_or_mesh`` (a name, or a ``ProcMesh``/job with a
    ``.name``); None: the most recently written one."""
    root = pathlib.Path(root) if root is not None else places.history_root()
    name = name_or_mesh if name_or_mesh is None or isinstance(name_or_mesh, str) else name_or_mesh.name
    flush()
    pending.wait_written(root)
    if name is not None:
        gather(name, root)  # a mesh of this process's on other hosts: their files first
    records = list_histories(root)
    if name is None:
        if not records:
            raise HistoryNotFound(f"no history under {root} yet: spawn a mesh (its ranks' output is recorded), "
                                  f"or set history_dir (MONARCH_KERNEL_HISTORY_DIR) to where histories are")
        latest = max(records, key=lambda r: r.last)
        return History(latest.folder, latest)
    for record in records:
        if record.name == name or record.folder.name == places.safe(name):
            return History(record.folder, record)
    known = ", ".join(sorted(r.name for r in records)) or "none"
    raise HistoryNotFound(f"no history named {name!r} under {root} (there: {known}); "
                          f"`%mesh history --list` lists them")
