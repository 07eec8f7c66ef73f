"""Looking at values: ``fetch_shard`` (a Future of one rank's shard), ``inspect`` (its
value now), ``show`` (for a notebook) and ``call_on_shard_and_fetch``.  Each sends what was
recorded first, so the value is the one the code before it computed; a poisoned value
raises ``RemoteException`` with the rank's traceback.

Example::

    with procs.activate():
        t = torch.rand(3, 4)
    fetch_shard(t, gpus=1).get()          # rank 1's 3x4 tensor
    inspect(t)                            # rank 0's, now
"""

from __future__ import annotations

from ..errors import RemoteException
from ..messages import Poisoned
from .meshes import TensorMesh, active, mesh_of


def _raise_poisoned(value):
    """The fetched value, or its poison raised (looked for in lists, tuples and dicts)."""
    p = _first_poisoned(value)
    if p is not None:
        raise RemoteException(p)
    return value


def _first_poisoned(value):
    if type(value) is Poisoned:
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            p = _first_poisoned(v)
            if p is not None:
                return p
    elif isinstance(value, dict):
        return _first_poisoned(list(value.values()))
    return None


def _mesh_for(obj, what: str) -> TensorMesh:
    mesh = mesh_of(obj) or active()
    if mesh is None:
        raise ValueError(f"{what} needs a distributed tensor, or an active mesh (`with procs.activate():`)")
    return mesh


def fetch_shard(obj, shard: dict | None = None, **coords):
    """A Future of ``obj`` (a distributed tensor, or lists/tuples/dicts with some) as the
    rank at ``coords`` has it (dims left out: 0); its tensors come back detached, on the CPU.

    Example::

        with procs.activate():
            t = torch.rand(3)
        monarch.fetch_shard(t, gpus=2).get()   # rank 2's shard, a plain tensor
    """
    mesh = _mesh_for(obj, "fetch_shard")
    rank = mesh.rank_at(shard, **coords)
    return mesh.client.request(rank, None, (obj,), {}, _raise_poisoned)


def inspect(obj, shard: dict | None = None, **coords):
    """``fetch_shard(obj, ...).get()``: the shard's value now.

    Example::

        with procs.activate():
            t = torch.ones(2) * 3
        monarch.inspect(t, gpus=0)            # tensor([3., 3.])
    """
    return fetch_shard(obj, shard, **coords).get()


def call_on_shard_and_fetch(fn, *args, shard: dict | None = None, **kwargs):
    """A Future of ``fn(*args, **kwargs)`` run on one rank (``shard``: its coordinates; 0 by
    default), distributed tensors in the arguments as that rank's shards.  ``fn``: a
    ``@remote`` function or a plain one.

    Example::

        monarch.call_on_shard_and_fetch(torch.cuda.device_count, shard={"gpus": 1}).get()
    """
    mesh = _mesh_for((args, kwargs), "call_on_shard_and_fetch")
    rank = mesh.rank_at(shard)
    return mesh.client.request(rank, getattr(fn, "function", fn), args, kwargs, _raise_poisoned)


class Shown:
    """What ``show`` returns: one shard rendered (its own ``_repr_html_`` if it has one), or a
    table of the shards at several coordinates."""

    def __init__(self, rows: list[tuple[dict, object]]):
        self.rows = rows

    def __repr__(self) -> str:
        if len(self.rows) == 1:
            return repr(self.rows[0][1])
        return "\n".join(f"{_coords(c)}: {v!r}" for c, v in self.rows)

    def _repr_html_(self) -> str:
        import html

        def cell(v) -> str:
            r = getattr(v, "_repr_html_", None)
            return r() if r is not None else f"<pre>{html.escape(repr(v))}</pre>"

        if len(self.rows) == 1:
            return cell(self.rows[0][1])
        body = "".join(f"<tr><td><code>{html.escape(_coords(c))}</code></td><td>{cell(v)}</td></tr>"
                       for c, v in self.rows)
        return f"<table><tr><th>shard</th><th>value</th></tr>{body}</table>"


def _coords(c: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items()) or "rank 0"


def show(obj, shard: dict | None = None, **coords) -> Shown:
    """One shard for display in a notebook (rank 0 by default); a coordinate given as a
    range, slice or list (``show(t, gpus=range(4))``), or None for a whole dim, shows a small
    table of every shard it selects.

    Example::

        monarch.show(t, gpus=range(4))        # one small table per rank, in a notebook
    """
    import itertools

    mesh = _mesh_for(obj, "show")
    where = dict(shard or {}, **coords)
    axes = []
    for label, size in zip(mesh.labels, mesh.sizes, strict=True):
        if label not in where:
            continue
        c = where[label]
        if c is None:
            c = range(size)
        elif isinstance(c, slice):
            c = range(size)[c]
        axes.append([(label, i) for i in (c if isinstance(c, (range, list, tuple)) else [c])])
    points = [dict(p) for p in itertools.product(*axes)] or [{}]
    futures = [(p, fetch_shard(obj, p)) for p in points]
    return Shown([(p, f.get()) for p, f in futures])
