"""A run's history that outlives the kernel and the allocation: every host writes its ranks'
lines, lifecycle events, metrics and samples as Parquet files it owns (``writer``,
``recorder``, ``metric``), and ``history(name).sql(...)`` asks them in SQL with DuckDB
(``query``).  Stands on the runtime only.  Importing it records nothing and loads neither
pyarrow, DuckDB nor pandas.

``monarch_kernel.history`` is this package, and calling it opens a history::

    h = monarch_kernel.history("train")       # or None: the most recent
    h.sql("SELECT rank, count(*) FROM lines GROUP BY rank")
    monarch_kernel.history.list_histories()
"""

from __future__ import annotations

import sys
import types

from .columns import VIEWS
from .gather import copy_home, gather
from .listing import HistoryRecord, list_histories
from .metric import metric
from .places import history_root, hosts_env
from .query import History, HistoryNotFound, open_history
from .recorder import flush, record_event, record_history, record_stacks, set_cell

__all__ = [
    "VIEWS", "History", "HistoryNotFound", "HistoryRecord", "copy_home", "flush", "gather", "history_root", "hosts_env",
    "list_histories", "metric",
    "open_history", "record_event", "record_history", "record_stacks", "set_cell",
]


class _CallableModule(types.ModuleType):
    """This package, callable: ``monarch_kernel.history(name)`` is ``open_history(name)``."""

    def __call__(self, name_or_mesh=None, *, root=None) -> History:
        return open_history(name_or_mesh, root=root)


sys.modules[__name__].__class__ = _CallableModule
