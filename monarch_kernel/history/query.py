"""A history, asked in SQL: DuckDB over the Parquet files of one run of a mesh or job (every
host's folder under it), or of all its runs, with the views of ``columns.VIEWS`` (their
``run`` column is the run's folder: the files do not store it).  Reads only; never writes a
history.  DuckDB and pandas load on the first query."""

from __future__ import annotations

import pathlib
from typing import Any

from . import places
from .columns import VIEWS, empty_select
from .convert import convert
from .gather import gather
from .listing import HistoryRecord, list_histories
from .recorder import current_run, flush


class HistoryNotFound(LookupError):
    """No history of that name under the root."""


class History:
    """One run's history of a mesh (or job), or all its runs (``run="all"``): ``sql(query)``
    returns a pandas DataFrame.

    Example::

        h = monarch_kernel.history("train")                  # its latest run
        h.sql("SELECT rank, count(*) AS n FROM lines GROUP BY rank ORDER BY rank")
        monarch_kernel.history("train", run="all").sql("SELECT run, count(*) FROM lines GROUP BY run")
    """

    views = list(VIEWS)

    def __init__(self, records: list[HistoryRecord], *, every: bool = False):
        """``records``: the runs asked, newest first; ``every``: all runs of the name."""
        self.runs = records
        self.record = records[0]  # the newest run asked
        self.name = self.record.name
        self.run = places.ALL if every else self.record.run
        self.folder = self.record.mesh_folder if every else self.record.folder
        self._con: Any = None

    def __repr__(self) -> str:
        return f"History({self.name!r}, run={self.run!r}, {str(self.folder)!r})"

    def files(self, view: str, record: HistoryRecord | None = None) -> list[str]:
        """The files of ``view`` of run ``record`` (default: every run asked)."""
        return sorted(str(p) for r in ([record] if record is not None else self.runs)
                      for p in r.folder.glob(f"*/{view}-*.parquet"))

    def _view(self, view: str) -> str:
        """SQL for ``view``: each run's files with its run, in the documented column order."""
        parts = []
        for record in self.runs:
            files = self.files(view, record)
            if files:
                listed = ", ".join(_quoted(f) for f in files)
                parts.append(f"SELECT time, mesh, {_quoted(record.run)} AS run, * EXCLUDE (time, mesh) "
                             f"FROM read_parquet([{listed}], union_by_name=true)")
        return " UNION ALL BY NAME ".join(parts) if parts else empty_select(view)

    def connect(self):
        """A DuckDB connection with this history's views (made again on each call: files come
        and go as hosts write and rotate)."""
        import duckdb

        flush()  # rows this process gathered and has not spooled yet
        convert(self.record.mesh_folder.parent)  # ... and every process's spooled rows, a killed one's too
        con = duckdb.connect(":memory:")
        con.execute("SET TimeZone = 'UTC'")
        for view in VIEWS:
            con.execute(f"CREATE VIEW {view} AS {self._view(view)}")
        return con

    def sql(self, query: str):
        """The result of ``query`` (DuckDB's SQL over the views ``lines``, ``events``, ``metrics``,
        ``samples``, ``stacks``) as a pandas DataFrame."""
        import duckdb

        for attempt in range(1, READS + 1):
            con = None
            try:
                con = self.connect()  # its views read the files as listed: a file may go before they do
                rel = con.sql(query)
                return rel.df() if rel is not None else None
            except duckdb.IOException:
                if attempt == READS:
                    raise  # a file merged or dropped by the cap between listing and reading: list again
            finally:
                if con is not None:
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


READS = 5  # a query lists the files again this many times at most, while hosts merge and drop them


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def open_history(name_or_mesh=None, *, root=None, run: str | None = None) -> History:
    """The history of mesh or job ``name_or_mesh`` (a name, or a ``ProcMesh``/job with a
    ``.name``; None: the most recently written one's).  ``run``: None, its latest run (the
    run this process spawned, for a mesh it spawned); a run id (or the start of one) of
    ``list_histories()``; ``"all"``: every run, told apart by the views' ``run`` column."""
    root = pathlib.Path(root) if root is not None else places.history_root()
    name = name_or_mesh if name_or_mesh is None or isinstance(name_or_mesh, str) else name_or_mesh.name
    mine = current_run(name_or_mesh) if name_or_mesh is not None and run is None else None
    flush()
    if name is not None:
        gather(name, root)  # a mesh of this process's on other hosts: their files first
    records = list_histories(root)
    if name is None:
        if not records:
            raise HistoryNotFound(f"no history under {root} yet: spawn a mesh (its ranks' output is recorded), "
                                  f"or set history_dir (MONARCH_KERNEL_HISTORY_DIR) to where histories are")
        name = max(records, key=lambda r: r.last).name
    runs = sorted((r for r in records if r.name == name or r.mesh_folder.name == places.safe(name)),
                  key=lambda r: r.first, reverse=True)
    if not runs:
        known = ", ".join(sorted({r.name for r in records})) or "none"
        raise HistoryNotFound(f"no history named {name!r} under {root} (there: {known}); "
                              f"`%mesh history --list` lists them")
    if run == places.ALL:
        return History(runs, every=True)
    if run is None:
        return History([next((r for r in runs if r.run == mine), runs[0])])
    chosen = [r for r in runs if r.run == run] or [r for r in runs if r.run.startswith(run)]
    if len(chosen) != 1:
        said = "more than one run" if chosen else "no run"
        raise HistoryNotFound(f"{name!r} has {said} {run!r} under {root}; its runs, newest first: "
                              f"{', '.join(r.run for r in runs)} (or run='all': every run)")
    return History(chosen)
