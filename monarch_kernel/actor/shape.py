"""Named dimensions: ``Extent`` (dim -> size), ``Point`` (a coordinate in one), and
``Shape`` (an extent plus which proc-mesh rank sits at each of its points, so slices of
slices keep pointing at the right processes).
"""

from __future__ import annotations

import itertools
import keyword
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from ..runtime import counted


def check_dim(label, where: str) -> str:
    """``label`` if it can name a dim, else ``ValueError`` (``TypeError`` for no string):
    dims are keyword arguments of ``slice`` (``mesh.slice(gpus=0)``), so each is an ASCII
    Python identifier that is not a keyword (what Monarch prints bare, unquoted)."""
    if not isinstance(label, str):
        raise TypeError(f"{where}: a dim is named by a string, e.g. 'gpus'; got {label!r}")
    if not (label.isascii() and label.isidentifier()) or keyword.iskeyword(label):
        raise ValueError(f"{where}: {label!r} cannot name a dim: dims are keyword arguments of slice "
                         f"(mesh.slice(gpus=0)), so a dim is a Python identifier (ASCII letters, digits and '_', "
                         f"not starting with a digit) and no keyword, e.g. 'gpus'")
    return label


class Extent(Mapping):
    """Ordered ``dim -> size``; ``Extent({"hosts": 2, "gpus": 4})``.

    Example::

        e = Extent({"hosts": 2, "gpus": 4})
        e.nelem                             # 8
    """

    __slots__ = ("labels", "sizes")

    def __init__(self, dims):
        items = list(dims.items() if isinstance(dims, Mapping) else dims)
        self.labels = tuple(str(k) for k, _ in items)
        self.sizes = tuple(int(v) for _, v in items)

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self):
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nelem(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def describe(self) -> str:
        return ", ".join(f"{label}={s}" for label, s in zip(self.labels, self.sizes, strict=True)) or "(no dims)"

    def __repr__(self) -> str:
        return "{" + ", ".join(f"'{label}': {s}" for label, s in zip(self.labels, self.sizes, strict=True)) + "}"

    def __eq__(self, other) -> bool:
        if isinstance(other, Extent):
            return self.labels == other.labels and self.sizes == other.sizes
        return Mapping.__eq__(self, other)

    def __hash__(self):
        return hash((self.labels, self.sizes))


class Point(Mapping):
    """A coordinate in an extent; a mapping ``dim -> index`` whose ``.rank`` is the flat
    row-major index, so ``mesh.slice(**point)`` selects it.

    Example::

        p = current_rank()                  # on a rank of a {"hosts": 2, "gpus": 4} mesh
        p.rank, p["gpus"]                   # e.g. (5, 1)
    """

    __slots__ = ("coords", "extent")

    def __init__(self, coords, extent: Extent):
        self.coords = tuple(coords)
        self.extent = extent

    @classmethod
    def from_rank(cls, rank: int, extent: Extent) -> Point:
        coords = []
        for size in reversed(extent.sizes):
            coords.append(rank % size if size else 0)
            rank = rank // size if size else 0
        return cls(reversed(coords), extent)

    @property
    def rank(self) -> int:
        r = 0
        for c, s in zip(self.coords, self.extent.sizes, strict=False):
            r = r * s + c
        return r

    def __getitem__(self, label: str) -> int:
        try:
            return self.coords[self.extent.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self):
        return iter(self.extent.labels)

    def __len__(self) -> int:
        return len(self.coords)

    def __repr__(self) -> str:
        # Monarch's wording, which its users print and match: {'hosts': 0/2, 'gpus': 1/4}.
        parts = (f"'{label}': {c}/{size}"
                 for label, c, size in zip(self.extent.labels, self.coords, self.extent.sizes, strict=False))
        return "{" + ", ".join(parts) + "}"

    def __eq__(self, other) -> bool:
        if isinstance(other, Point):
            return self.coords == other.coords and self.extent == other.extent
        return Mapping.__eq__(self, other)

    def __hash__(self):
        return hash((self.coords, self.extent))


class Shape:
    """An extent and the proc-mesh rank at each of its points (row-major).

    Example::

        procs.shape.extent                  # Extent({'gpus': 4})
        procs.slice(gpus=2).shape.ranks       # [2]
    """

    __slots__ = ("extent", "ranks")

    def __init__(self, extent: Extent, ranks):
        self.extent = extent
        self.ranks = tuple(ranks)
        if len(self.ranks) != extent.nelem:
            raise ValueError(f"{counted(len(self.ranks), 'rank')} do not fill extent {extent!r}")

    @classmethod
    def full(cls, dims) -> Shape:
        e = Extent(dims)
        return cls(e, range(e.nelem))

    def __len__(self) -> int:
        return len(self.ranks)

    def points(self) -> Iterator[Point]:
        for i in range(len(self.ranks)):
            yield Point.from_rank(i, self.extent)

    def index(self, where) -> int:
        """Flat index of a ``Point``, a ``{dim: index}`` mapping, or an int."""
        if isinstance(where, int):
            if not 0 <= where < len(self.ranks):
                raise IndexError(f"index {where} is out of range for a mesh of {counted(len(self.ranks), 'rank')}")
            return where
        if isinstance(where, Mapping):
            unknown = set(where) - set(self.extent.labels)
            missing = set(self.extent.labels) - set(where)
            if unknown or missing:
                raise KeyError(
                    f"a point needs exactly the dims {self.extent.describe()}; "
                    f"got {dict(where)!r}"
                )
            flat = 0
            for label, size in zip(self.extent.labels, self.extent.sizes, strict=True):
                c = where[label]
                if not 0 <= c < size:
                    raise IndexError(
                        f"{label}={c} is out of range; dimension '{label}' has size {size} (0..{size - 1})")
                flat = flat * size + c
            return flat
        raise TypeError(f"index a mesh with a Point, a dict of dims or an int, not {type(where).__name__}")

    def slice(self, **dims) -> Shape:
        labels, sizes = self.extent.labels, self.extent.sizes
        for k in dims:
            if k not in labels:
                raise ValueError(
                    f"mesh has no dimension {k!r}; its dimensions are {self.extent.describe()} "
                    f"(slice with one of: {', '.join(labels) or 'none: it has a single rank'})"
                )
        axes = []
        new_labels, new_sizes = [], []
        for label, size in zip(labels, sizes, strict=True):
            sel = dims.get(label)
            if sel is None:
                idx = list(range(size))
                new_labels.append(label)
                new_sizes.append(size)
            elif isinstance(sel, int):
                if not -size <= sel < size:
                    raise IndexError(
                        f"{label}={sel} is out of range; dimension '{label}' has size {size} (0..{size - 1})")
                idx = [sel % size]
            elif isinstance(sel, (slice, range)):
                s = sel if isinstance(sel, slice) else slice(sel.start, sel.stop, sel.step)
                if (s.start is not None and not -size <= s.start <= size) or (
                    s.stop is not None and not -size - 1 <= s.stop <= size
                ):
                    raise IndexError(f"{label}={s.start}:{s.stop} is out of range; "
                                     f"dimension '{label}' has size {size} (0..{size - 1})")
                idx = list(range(size))[s]
                if not idx:
                    raise IndexError(f"{label}={sel!r} selects nothing; dimension '{label}' has size {size}")
                new_labels.append(label)
                new_sizes.append(len(idx))
            else:
                raise TypeError(f"slice {label}= takes an int, a slice or a range, not {type(sel).__name__}")
            axes.append(idx)
        strides = []
        acc = 1
        for size in reversed(sizes):
            strides.append(acc)
            acc *= size
        strides.reverse()
        ranks = [
            self.ranks[sum(c * st for c, st in zip(combo, strides, strict=True))]
            for combo in itertools.product(*axes)
        ]
        return Shape(Extent(zip(new_labels, new_sizes, strict=True)), ranks)

    def flatten(self, dim: str) -> Shape:
        """All dims folded into one called ``dim``, points in row-major order (any shape,
        sliced ones included: it keeps the ranks, not a stride)."""
        if not isinstance(dim, str) or not dim:
            raise TypeError(f"flatten takes the new dimension's name, e.g. flatten('rank'); got {dim!r}")
        check_dim(dim, "flatten")
        return Shape(Extent({dim: len(self.ranks)}), self.ranks)

    def rename(self, **names: str) -> Shape:
        """Dims renamed, the rest kept, the same points and ranks:
        ``rename(hosts="dp", gpus="tp")``."""
        for old, new in names.items():
            if not isinstance(new, str) or not new:
                raise TypeError(f"rename takes new names as strings, e.g. rename({old}='dp'); got {old}={new!r}")
            check_dim(new, "rename")
        return self.split(**{old: (new,) for old, new in names.items()})

    def split(self, **kwargs) -> Shape:
        """Dims split into several, row-major (so the ranks keep their order), as Monarch's
        ``mesh.split(hosts=("dp", "pp"), gpus=("tp", "cp"), pp=2, cp=2)``: a dim maps to
        the names it becomes, a new name to its size; one new name per split may go
        unsized, and is what is left."""
        labels = self.extent.labels
        splits: dict[str, tuple] = {}
        sizes: dict[str, int] = {}
        for key, value in kwargs.items():
            if key in labels:
                if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
                    raise TypeError(f"split {key}= takes the names it becomes, e.g. {key}=('dp', 'pp'); "
                                    f"got {value!r}")
                splits[key] = tuple(value)
            elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
                sizes[key] = value
            else:
                raise ValueError(f"{key!r} is not a dim of this mesh ({self.extent.describe()}), so split takes it "
                                 f"as a new dim's size, a positive int; got {key}={value!r}")
        out: list[tuple[str, int]] = []
        for label, size in zip(labels, self.extent.sizes, strict=True):
            names = splits.get(label, (label,))
            unsized = [n for n in names if n not in sizes]
            if len(unsized) > 1:
                raise ValueError(f"split {label}={names!r} leaves {unsized[0]!r} and {unsized[1]!r} unsized; give "
                                 f"all but one a size, e.g. {unsized[1]}=2")
            known = 1
            for n in names:
                known *= sizes.get(n, 1)
            if unsized:
                if size % known:
                    raise ValueError(f"dim {label!r} of size {size} does not split evenly into {names!r} "
                                     f"(the sized ones make {known})")
                sizes[unsized[0]] = size // known
            elif known != size:
                raise ValueError(f"dim {label!r} has size {size}, but {names!r} multiply to {known}")
            out.extend((n, sizes.pop(n)) for n in names)
        names_out = [check_dim(n, "split") for n, _ in out]
        dup = sorted({n for n in names_out if names_out.count(n) > 1})
        if dup:
            raise ValueError(f"the split mesh would have dim {dup[0]!r} twice; give each dim its own name")
        if sizes:
            raise ValueError(f"split was given sizes of {', '.join(map(repr, sizes))}, which no dim splits into")
        return Shape(Extent(out), self.ranks)

    def __repr__(self) -> str:
        return f"Shape({self.extent!r}, ranks={list(self.ranks)})"


_S = TypeVar("_S", bound="Shaped")


class Shaped:
    """Mixin for things laid out over a ``Shape`` held in ``self._shape``."""

    __slots__ = ()
    _shape: Shape  # a slot of the class that mixes this in

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    @property
    def shape(self) -> Shape:
        return self._shape

    def __len__(self) -> int:
        return len(self._shape)

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """How many points: in all (``None``), along ``dim``, or across several dims."""
        extent = self._shape.extent
        if dim is None:
            return extent.nelem
        if isinstance(dim, str):
            if dim not in extent.labels:
                raise KeyError(f"{self!r} has no dimension {dim!r}; its dimensions are {extent.describe()}")
            return extent[dim]
        n = 1
        for d in dim:
            n *= self.size(d)
        return n

    # Views: the same things over another shape, as ``_with_shape`` (the class's own) makes them.
    def _with_shape(self: _S, shape: Shape) -> _S:
        raise NotImplementedError

    def slice(self: _S, **dims) -> _S:
        """The sub-mesh at ``dims`` (ints drop a dim; slices and ranges keep it)."""
        return self._with_shape(self._shape.slice(**dims))

    def flatten(self: _S, dim: str) -> _S:
        """The same over one dimension ``dim`` (``{"hosts": 2, "gpus": 4}`` -> ``{dim: 8}``),
        in row-major order; calls see ``message_rank`` in it."""
        return self._with_shape(self._shape.flatten(dim))

    def rename(self: _S, **names: str) -> _S:
        """The same with dims renamed, the rest kept: ``procs.rename(gpus="tp")``."""
        return self._with_shape(self._shape.rename(**names))

    def split(self: _S, **kwargs) -> _S:
        """The same with dims split into several, row-major, as Monarch's:
        ``procs.split(hosts=("dp", "pp"), pp=2)`` turns ``{"hosts": 4, "gpus": 8}`` into
        ``{"dp": 2, "pp": 2, "gpus": 8}`` (one new name per split may go unsized)."""
        return self._with_shape(self._shape.split(**kwargs))

    @property
    def sizes(self) -> dict[str, int]:
        """``{dim: size}``, in order."""
        return dict(self._shape.extent)
