"""``ValueMesh``: one value per point of a mesh, keeping the mesh's shape.

Example::

    vm = trainers.loss.call().get()
    vm[{"gpus": 1}], vm.slice(gpus=0), list(vm.values())
    for point, value in vm.items(): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from ..runtime import counted
from .shape import Point, Shape, Shaped

R = TypeVar("R")


class ValueMesh(Shaped, Generic[R]):
    """One value per rank of a mesh: what ``call`` answers; sliced like the mesh it came from.

    Example::

        losses = trainers.step.call(8).get()
        losses.item(gpus=0)                 # rank 0's value
        for point, loss in losses.items():
            print(point.rank, loss)
    """

    __slots__ = ("_shape", "_values")

    def __class_getitem__(cls, _item):
        """``ValueMesh[...]`` is the class itself at run time, as in Monarch (the parameter is
        for type checkers), so it can be called, subclassed and compared."""
        return cls

    def __init__(self, shape: Shape, values: list):
        if len(values) != len(shape):
            raise ValueError(f"{counted(len(values), 'value')} for a mesh of {counted(len(shape), 'point')}")
        self._shape = Shape(shape.extent, range(len(shape)))
        self._values = list(values)


    def items(self) -> Iterator[tuple[Point, R]]:
        return zip(self._shape.points(), self._values, strict=True)

    def values(self) -> Iterator[R]:
        return iter(self._values)

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __getitem__(self, where) -> R:
        return self._values[self._shape.index(where)]

    def item(self, **dims) -> R:
        """The value at the point named by ``dims`` (``vm.item(gpus=2)``)."""
        return self[dims] if dims else self._single()

    def _single(self):
        if len(self._values) != 1:
            raise ValueError(f"item() without dims needs a single value; "
                             f"this mesh has {len(self._values)} ({self.extent.describe()})")
        return self._values[0]

    def slice(self, **dims) -> ValueMesh[R]:
        sub = self._shape.slice(**dims)
        return ValueMesh(sub, [self._values[i] for i in sub.ranks])

    def flatten(self, dim: str) -> ValueMesh[R]:
        """The same values over one dimension ``dim`` (``vm.flatten("rank").slice(rank=3)``)."""
        return ValueMesh(self._shape.flatten(dim), self._values)

    def __eq__(self, other) -> bool:
        return isinstance(other, ValueMesh) and self.extent == other.extent and self._values == other._values

    def __repr__(self) -> str:
        body = ", ".join(
            f"{{{', '.join(f'{label}={c}' for label, c in zip(self.extent.labels, p.coords, strict=True))}}}: {v!r}"
            for p, v in self.items()
        )
        return f"ValueMesh({self.extent!r}, {{{body}}})"
