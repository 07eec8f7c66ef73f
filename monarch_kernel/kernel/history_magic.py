"""``%mesh history``: the run's history, asked in SQL (a pandas DataFrame), plotted, or listed;
and what the kernel adds to it that only it knows (cells, interrupts, watchdog alarms and the
stacks it took).  Runs in the kernel; the history itself is ``monarch_kernel.history``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from .. import history

if TYPE_CHECKING:
    from ..observe.stack_report import StackReport


def history_command(session, a):
    """Run ``%mesh history`` with parsed arguments ``a``."""
    root = a.root
    if a.list:
        import pandas as pd

        rows = [r.to_json() for r in history.list_histories(root)]
        return pd.DataFrame(rows, columns=["name", "run", "kind", "hosts", "first", "last", "state", "ranks",
                                           "folder"])
    if a.views:
        print(history.columns.markdown())
        return None
    name = a.mesh or session.current
    try:
        h = history.open_history(name, root=root, run=a.run)
    except history.HistoryNotFound as e:
        if a.mesh is None and a.run is None and name is not None:  # the current mesh wrote nothing yet: the latest
            h = history.open_history(None, root=root)
        else:
            raise UsageError(str(e)) from None
    if a.plot:
        import matplotlib.pyplot as plt

        try:
            h.plot(a.plot)
        except LookupError as e:
            raise UsageError(f"%mesh history --plot {a.plot}: {e}") from None
        plt.show()
        return None
    query = sql_text(a.query)
    if not query:
        raise UsageError('%mesh history needs a query, --plot NAME, --list or --views; type  '
                         '%mesh history "SELECT rank, count(*) FROM lines GROUP BY rank"')
    import duckdb

    try:
        return h.sql(query)
    except duckdb.Error as e:
        raise UsageError(f"%mesh history: {e}".rstrip() + f"\n(the views: {', '.join(h.views)}; "
                         "%mesh history --views shows their columns)") from None


def sql_text(words: list[str]) -> str:
    """The query as typed: its words joined, one pair of outer quotes taken off."""
    query = " ".join(words).strip()
    if len(query) >= 2 and query[0] == query[-1] and query[0] in "'\"":
        query = query[1:-1]
    return query.strip()


def record_stacks(report: StackReport, reason: str) -> None:
    """Each rank's stacks of ``report`` into the history (``reason``: ``watchdog``, ``stacks``)."""
    for s in report.stacks:
        if s.error:
            text = s.error
        else:
            text = "\n".join(f"thread {t.name}:\n" + "\n".join(f"  {report.frame_text(f)}" for f in t.frames)
                             for t in s.threads)
        history.record_stacks(report.mesh, s.rank, reason, text, host=s.host or None)


def record_samples(mesh: str, points: dict, hosts: dict[int, str]) -> None:
    """``%mesh top``'s sample of each rank (``RankMetrics.sample``'s points) into the history."""
    for r, p in points.items():
        if p.pid is not None:
            history.record_sample(mesh, r, hosts.get(r) or None, p.pid, p.cpu, p.rss_mib, p.gpu, p.gpu_mib)
