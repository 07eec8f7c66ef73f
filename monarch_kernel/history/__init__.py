"""A run's history that outlives the kernel and the allocation: every host writes its ranks'
lines, lifecycle events, metrics and samples as Parquet files it owns, one folder per run
(one spawn) of a mesh (``writer``, ``recorder``, ``metric``), and ``history(name).sql(...)``
asks them in SQL with DuckDB (``query``).  Stands on the runtime only.  Importing it records nothing and loads neither
pyarrow, DuckDB nor pandas.

``monarch_kernel.history`` is this package, and calling it opens a history::

    h = monarch_kernel.history("train")       # its latest run; None: the most recent mesh's
    h.sql("SELECT rank, count(*) FROM lines GROUP BY rank")
    monarch_kernel.history("train", run="all").sql("SELECT run, count(*) FROM lines GROUP BY run")
    monarch_kernel.history.list_histories()   # one record per run
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from ..runtime.hosting import lazy_names

# Each name loads its module when first asked for (``lazy_names`` reads these lines): the
# history's writer process, which imports this package's parquet_files, loads no more.
if TYPE_CHECKING:
    # isort: off
    from .columns import VIEWS as VIEWS
    from .gather import copy_home as copy_home
    from .gather import gather as gather
    from .listing import HistoryRecord as HistoryRecord
    from .listing import list_histories as list_histories
    from .metric import metric as metric
    from .places import history_root as history_root
    from .places import hosts_env as hosts_env
    from .query import History as History
    from .query import HistoryNotFound as HistoryNotFound
    from .query import open_history as open_history
    from .recorder import begin_run as begin_run
    from .recorder import current_run as current_run
    from .recorder import flush as flush
    from .recorder import record_event as record_event
    from .recorder import record_history as record_history
    from .recorder import record_sample as record_sample
    from .recorder import record_stacks as record_stacks
    from .recorder import set_cell as set_cell
    # isort: on

__getattr__, _ = lazy_names(__name__, __file__)

# The public names (what the docs render); the kernel, the agents and jobs also use the
# recording and gathering functions named above.
__all__ = ["VIEWS", "History", "HistoryNotFound", "HistoryRecord", "history_root", "list_histories", "metric",
           "open_history"]


class _CallableModule(types.ModuleType):
    """This package, callable: ``monarch_kernel.history(name)`` is ``open_history(name)``."""

    def __call__(self, name_or_mesh=None, *, root=None, run=None) -> History:
        from .query import open_history

        return open_history(name_or_mesh, root=root, run=run)


sys.modules[__name__].__class__ = _CallableModule
