"""Which mesh torch calls are recorded for: ``TensorMesh`` (a set of ranks of one client,
with named dims), its ``activate()`` context, ``no_mesh`` and ``get_active_mesh()``.

The shape object comes from the layer above (the actor layer's ``Shape``) and is used only
through ``extent.labels``, ``extent.sizes``, ``ranks`` and ``slice(**dims)``.
"""

from __future__ import annotations

import contextlib
from typing import Any


class _State:
    mesh: TensorMesh | None = None  # the mesh recording now (None: none, or inside no_mesh)
    depth = 0  # activate() blocks entered and not left
    stream: Any = None  # the Stream recording now (None: the main one)


state = _State()


class TensorMesh:
    """The ranks a distributed tensor lives on: ``shape`` (named dims over ranks of the
    client's proc mesh) and the ``client`` that records for them; ``owner`` is what users
    see as its mesh (the ``ProcMesh``)."""

    def __init__(self, client, shape, owner: Any = None):
        self.client = client
        self.shape = shape
        self.owner = owner if owner is not None else self
        self.labels: tuple = tuple(shape.extent.labels)
        self.sizes: tuple = tuple(shape.extent.sizes)
        self.ranks: tuple = tuple(shape.ranks)
        self.rank_set = None if len(self.ranks) == client.world else frozenset(self.ranks)

    def same(self, other: TensorMesh) -> bool:
        return self is other or (self.client is other.client and self.ranks == other.ranks)

    def describe(self) -> str:
        dims = ", ".join(f"{label}={s}" for label, s in zip(self.labels, self.sizes, strict=True)) or "one rank"
        return f"'{self.client.name}' {{{dims}}}"

    def __repr__(self) -> str:
        return f"TensorMesh({self.describe()})"

    def slice(self, **coords) -> TensorMesh:
        return TensorMesh(self.client, self.shape.slice(**coords), _sliced_owner(self.owner, coords))

    def rank_at(self, shard: dict | None = None, **coords) -> int:
        """The client's rank at ``coords`` of this mesh (dims left out: index 0)."""
        where = dict(shard or {}, **coords)
        # A dim the mesh lacks is one of size 1 (Monarch's meshes have ``hosts`` even on one host).
        unknown = sorted(d for d in set(where) - set(self.labels) if where[d] != 0)
        if unknown:
            raise ValueError(f"the mesh {self.describe()} has no dimension {unknown[0]!r}; its dimensions are "
                             f"{', '.join(self.labels) or 'none'}")
        flat = 0
        for label, size in zip(self.labels, self.sizes, strict=True):
            c = where.get(label, 0)
            if not isinstance(c, int) or not -size <= c < size:
                raise IndexError(f"{label}={c!r} is not a coordinate of the mesh {self.describe()} "
                                 f"(0..{size - 1})")
            flat = flat * size + c % size
        return self.ranks[flat]

    @contextlib.contextmanager
    def activate(self):
        """Record torch calls for this mesh until the block ends.  What was recorded goes
        within ``tensor_flush`` seconds, or sooner with a fetch, which carries it to the rank
        it asks in the same message (a fetch right after the block is one message to it)."""
        from .recorder import RecordingMode

        previous = state.mesh
        state.mesh = self
        state.depth += 1
        mode = RecordingMode()
        mode.__enter__()
        try:
            yield self.owner
        finally:
            mode.__exit__(None, None, None)
            state.depth -= 1
            state.mesh = previous


def _sliced_owner(owner, coords):
    sl = getattr(owner, "slice", None)
    return sl(**coords) if sl is not None and not isinstance(owner, TensorMesh) else None


class _NoMesh:
    """``with no_mesh.activate():`` (or ``with no_mesh:``) inside ``activate()``: torch
    calls run here again, on the controller; distributed tensors may not be touched.

    Example::

        with procs.activate():
            with monarch.no_mesh.activate():
                local = torch.zeros(3)          # a plain tensor, here
    """

    @contextlib.contextmanager
    def activate(self):
        previous = state.mesh
        state.mesh = None
        try:
            yield None
        finally:
            state.mesh = previous

    def __enter__(self):
        self._cm = self.activate()
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def __repr__(self) -> str:
        return "no_mesh"


no_mesh = _NoMesh()


def get_active_mesh():
    """The mesh of the innermost ``activate()`` (its ``ProcMesh``), or None.

    Example::

        with procs.activate():
            assert monarch.get_active_mesh() is procs
    """
    m = state.mesh
    return None if m is None else m.owner


def active() -> TensorMesh | None:
    return state.mesh


def mesh_of(obj) -> TensorMesh | None:
    """The mesh of the first distributed tensor in ``obj`` (lists, tuples, dicts), else None."""
    from .tensor import Tensor

    if type(obj) is Tensor:
        return obj._mesh
    if isinstance(obj, (list, tuple)):
        for x in obj:
            m = mesh_of(x)
            if m is not None:
                return m
    elif isinstance(obj, dict):
        return mesh_of(list(obj.values()))
    return None


def slice_mesh(obj, **coords):
    """The same tensors seen as living on the slice ``coords`` of their mesh (each rank of
    the slice keeps its shard), for work on part of the mesh (``to_mesh`` pipelines).

    Example::

        first_two = monarch.slice_mesh(t, gpus=slice(0, 2))
    """
    from .recorder import rebind_on

    mesh = mesh_of(obj)
    if mesh is None:
        raise TypeError("slice_mesh takes distributed tensors (or lists, tuples and dicts of them)")
    return rebind_on(obj, mesh, mesh.slice(**coords))
