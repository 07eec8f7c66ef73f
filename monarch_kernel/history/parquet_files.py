"""One host's history on disk: batches of rows written as one Parquet file per view and run
of a mesh, small files merged as they pile up, and past the host's size cap
(``history_max_bytes``, every mesh and run together) the oldest files dropped first (so the
oldest run's go first), recorded as a ``history_dropped`` event.

Its user is whoever does the disk work: the controller's writer process
(``writer_process``) or a host agent's writer thread; pyarrow loads on the first write,
there, never in a controller.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import os
import pathlib
import time
from array import array
from dataclasses import dataclass, field

from ..runtime.hosting import SYNC_PATTERN
from . import places, size_cap
from .columns import row_columns, schema

Place = tuple[str, str | None]  # (mesh, run); run None: the mesh's newest run on disk (``places.latest_run``)
_FREE_TEXT = frozenset({"line", "stack", "detail"})  # columns of text written without dictionary or statistics
MERGE_AT = 32  # this many small files of one view and mesh are merged into one
SMALL_BYTES = 4 << 20  # a file under this (and under a 64th of the cap) is small: merged with others


@dataclass
class LineChunks:
    """One place's chunks of lines as columns, one entry per chunk, for arrow to read as
    they are (the converter's; a batch holds the chunks as recorded, which the controller
    pickles quicker than it could make these).  Each chunk's bytes are whole lines, each
    ended by a newline; ``ends[i]``: where chunk ``i`` ends in ``data``."""

    times: array  # 'q': microseconds since the epoch, when the chunk arrived
    ranks: array  # 'q'
    streams: tuple  # "stdout" or "stderr"
    cells: tuple  # the cell or call, or None
    ends: array  # 'q'
    data: bytes

    @classmethod
    def of(cls, chunks: list) -> LineChunks:
        """From the chunks of one place as they were recorded, ``(time, (mesh, run), rank,
        stream, cell, bytes)`` tuples (``(time, rank, stream, cell, bytes)`` in a batch spooled
        by an older recorder): transposed in C, no loop here."""
        cols = list(zip(*chunks, strict=True)) if chunks else [()] * 5
        times, ranks, streams, cells, blobs = cols if len(cols) == 5 else [cols[0], *cols[2:]]
        return cls(array("q", times), array("q", ranks), streams, cells,
                   array("q", itertools.accumulate(map(len, blobs))), b"".join(blobs))

    def __len__(self) -> int:
        return len(self.ends)


@dataclass
class Batch:
    """What a writer gathered since its last batch, and where it goes (plain values, so that
    it can be pickled to the writer process)."""

    root: str
    host: str
    max_bytes: int
    pid: int  # the recording process's (the listing tells a live history by it)
    metas: dict[Place, dict] = field(default_factory=dict)  # what the listing says of each run
    chunks: dict[Place, list] = field(default_factory=dict)  # chunks of lines, as ``HistoryWriter.lines`` recorded them
    rows: dict[tuple[str, str, str | None], list] = field(default_factory=dict)  # (view, mesh, run) -> rows

    def empty(self) -> bool:
        return not self.metas and not self.chunks and not any(self.rows.values())


@dataclass
class Staged:
    """A batch's files, built but not in place yet: (view, folder, temporary path, name)."""

    batch: Batch
    files: list[tuple[str, pathlib.Path, pathlib.Path, str]] = field(default_factory=list)

    def discard(self) -> None:
        for _view, _folder, tmp, _name in self.files:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


class ParquetFiles:
    """Batches in, Parquet files out, under ``root/<mesh>/<run>/<host>/``."""

    def __init__(self):
        self.root: pathlib.Path | None = None
        self.host = ""
        self.max_bytes = 0
        self._seq = 0
        self._small: dict[tuple[str, pathlib.Path], list[pathlib.Path]] = collections.defaultdict(list)
        self._newest: dict[str, str] = {}  # mesh -> the run its rows of no run go to (``_folder``)
        self.staging: pathlib.Path | None = None  # where files are built (default: their folder)
        self.guard: contextlib.AbstractContextManager = contextlib.nullcontext()  # held while files are placed

    def write(self, batch: Batch) -> None:
        """``batch``'s files built and put in place at once (none other converts it)."""
        self.commit(self.stage(batch))
        self.settle()

    def stage(self, batch: Batch) -> Staged:
        """``batch``'s files built, under temporary names (the costly part: a converter does it
        without holding the batch's lock)."""
        root = pathlib.Path(batch.root)
        if root != self.root or batch.host != self.host:  # the settings moved it
            self.root, self.host = root, batch.host
            self._small.clear()
            self._newest.clear()
        self.max_bytes = batch.max_bytes
        staged = Staged(batch)
        for place, got in batch.chunks.items():
            if not got:
                continue
            for piece in _line_pieces(LineChunks.of(got), max(64 << 10, self.max_bytes // 16)):
                staged.files.append(self._stage("lines", place[0], self._folder(place), piece))
        for (view, mesh, run), rows in batch.rows.items():
            if rows:
                staged.files.append(self._stage(view, mesh, self._folder((mesh, run)), list(zip(*rows, strict=True))))
        return staged

    def commit(self, staged: Staged) -> None:
        """Its files in place, then the listing's state: a reader that sees a run "ended"
        finds every line written with it."""
        for view, folder, tmp, name in staged.files:
            os.replace(tmp, folder / name)  # readers glob *.parquet: never half a file
            self._placed(view, folder, folder / name)
        for place, info in staged.batch.metas.items():
            self._write_meta(place, info, staged.batch.pid)

    def settle(self) -> None:
        """Small files merged, and the size cap kept (after a commit, with no lock held)."""
        for key in [k for k, small in self._small.items() if len(small) >= MERGE_AT]:
            self._merge(*key)
        self._cap()

    def _folder(self, place: Place) -> pathlib.Path:
        """This host's folder of run ``place`` (made); rows of no known run go to the mesh's
        newest run here (what a process that did not spawn it says of it: a kernel of a mesh
        it attached to), else to a run of their own."""
        assert self.root is not None
        mesh, run = place
        if run is None:
            run = self._newest.get(mesh) or places.latest_run(self.root, mesh) or places.new_run()
            self._newest[mesh] = run
        return places.host_dir(self.root, mesh, run, self.host)

    def _stage(self, view: str, mesh: str, folder: pathlib.Path, cols: list) -> tuple:
        """One file of ``view``'s rows for ``mesh`` in ``folder``, given as columns
        (``row_columns`` order), under a temporary name."""
        import pyarrow as pa

        sch = schema(view)
        arrays = {}
        for name, values in zip(row_columns(view), cols, strict=True):
            typ = sch.field(name).type
            if pa.types.is_timestamp(typ):  # from ints, then cast: 20 times quicker than ints to timestamps
                values = values if isinstance(values, pa.Array) else pa.array(values, pa.int64())
                arrays[name] = values.cast(typ)
            else:
                arrays[name] = values if isinstance(values, pa.Array) else pa.array(values, typ)
        n = len(cols[0])
        arrays["mesh"] = pa.repeat(mesh, n)
        if "host" not in arrays:
            arrays["host"] = pa.repeat(self.host, n)
        table = pa.table([arrays[name] for name in sch.names], schema=sch)
        return (view, folder, *self._tmp_file(folder, view, table))

    def _write(self, view: str, mesh: str, folder: pathlib.Path, cols: list) -> None:
        """One file of ``view``'s rows, in place at once."""
        _view, _folder, tmp, name = self._stage(view, mesh, folder, cols)
        with self.guard:
            os.replace(tmp, folder / name)
        self._placed(view, folder, folder / name)

    def _tmp_file(self, folder: pathlib.Path, view: str, table, name: str | None = None
                  ) -> tuple[pathlib.Path, str]:
        import pyarrow.parquet as pq

        self._seq += 1
        name = name or f"{view}-{time.time_ns()}-{os.getpid()}-{self._seq}.parquet"
        tmp = (self.staging or folder) / f".{os.getpid()}-{name}.tmp"  # a dead pid's are swept (spool_files)
        # a line is rarely repeated and never looked up by its min or max: no dictionary tried
        # on it, no statistics (a quarter of the time a file of lines takes)
        plain = [n for n in table.column_names if n not in _FREE_TEXT]
        pq.write_table(table, tmp, compression="zstd", use_dictionary=plain, write_statistics=plain)
        os.chmod(tmp, 0o600)
        return tmp, name

    def _placed(self, view: str, folder: pathlib.Path, path: pathlib.Path) -> None:
        if path.stat().st_size < min(SMALL_BYTES, self.max_bytes // 64):  # merged with others it could outgrow
            self._small[(view, folder)].append(path)  # the cap, which would drop the newest rows with it

    def _merge(self, view: str, folder: pathlib.Path) -> None:
        """Small files of one view become one (queries open fewer files); the new file takes
        the first one's place in time, so the oldest still go first."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        small, self._small[(view, folder)] = self._small[(view, folder)], []
        tables, there = [], []
        for p in small:
            try:
                tables.append(pq.read_table(p))
                there.append(p)
            except FileNotFoundError:  # dropped by the size cap meanwhile
                continue
        if not there:
            return
        first = there[0].name.split("-")[1]
        tmp, name = self._tmp_file(folder, view, pa.concat_tables(tables),
                                   f"{view}-{first}-{os.getpid()}-m{self._seq + 1}.parquet")
        with self.guard:  # the merged file and the files it replaces never both there after an exit
            os.replace(tmp, folder / name)
            for p in there:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def _write_meta(self, place: Place, info: dict, pid: int) -> None:
        folder = self._folder(place)
        places.write_meta(folder, places.meta_of(place[0], folder.parent.name, places.read_meta(folder), info,
                                                 self.host, pid))

    def _cap(self) -> None:
        """This host's files (its spool too) under the cap; what went said at once, in the
        run that lost them, in a file of its own."""
        assert self.root is not None
        _left, dropped = size_cap.trim(self.root, self.host, self.max_bytes)
        now = time.time_ns() // 1000
        for d in dropped:
            for small in self._small.values():
                small[:] = [p for p in small if p.name not in d.names]
            self._write("events", d.mesh, d.folder or self._folder((d.mesh, d.run)),
                        [[now], [self.host], [None], ["history_dropped"], [None], [None], [d.detail(self.max_bytes)]])


def _line_pieces(chunks: LineChunks, most: int) -> list[list]:
    """The ``lines`` view's columns (time, rank, stream, cell, line) of ``chunks``, in pieces
    of about ``most`` bytes, a file each (the size cap drops a long batch's oldest lines,
    never all of them with the newest); cut and spread by arrow's kernels: nothing here costs
    per line, nor per chunk."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n, data = len(chunks), chunks.data
    offsets = pa.Array.from_buffers(pa.int64(), n + 1, [None, pa.py_buffer(array("q", [0]) + chunks.ends)])
    if len(data) < 1 << 31:
        blobs = pa.Array.from_buffers(pa.binary(), n, [None, offsets.cast(pa.int32()).buffers()[1], pa.py_buffer(data)])
    else:
        blobs = pa.Array.from_buffers(pa.large_binary(), n, [None, offsets.buffers()[1], pa.py_buffer(data)])
    try:
        text = blobs.cast(pa.large_string() if blobs.type == pa.large_binary() else pa.string())
    except pa.ArrowInvalid:  # not UTF-8 somewhere: those chunks decoded as the notebook shows them
        text = pa.array([data[a:b].decode("utf-8", "replace") for a, b in itertools.pairwise([0, *chunks.ends])],
                        pa.large_string())
    parts = pc.split_pattern(pc.utf8_slice_codeunits(text, 0, -1), "\n")  # each chunk ends in a newline
    lines = pc.list_flatten(parts)
    if lines.type != pa.string():
        lines = lines.cast(pa.string())
    if b"\r" in data:  # a Windows line end's \r is not the line's
        lines = pc.utf8_rtrim(lines, characters="\r")
    ends = parts.offsets[1:]  # where each chunk's lines end: a chunk has one at least
    cols = []
    for values in (pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(chunks.times)]),
                   pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(chunks.ranks)]).cast(pa.int32()),
                   pa.array(chunks.streams, pa.string()), pa.array(chunks.cells, pa.string())):
        cols.append(pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(ends, values)))
    cols.append(lines)
    # a cell's end marker is the console's, not a line the rank printed (the regex only if one may be there)
    keep = None
    if SYNC_PATTERN[:13].encode() in data:
        marked = pc.match_substring_regex(lines, SYNC_PATTERN)
        if pc.any(marked).as_py():
            lines = pc.replace_substring_regex(lines, SYNC_PATTERN, "")
            cols[-1] = lines
            keep = pc.invert(pc.and_(marked, pc.equal(pc.utf8_length(lines), 0)))
    out = []
    first = 0
    while first < n:  # chunks [first, last) make a piece of about ``most`` bytes
        start = chunks.ends[first - 1] if first else 0
        last = min(bisect.bisect_left(chunks.ends, start + most, lo=first) + 1, n)
        a = ends[first - 1].as_py() if first else 0
        b = ends[last - 1].as_py()
        piece = [c.slice(a, b - a) for c in cols]
        if keep is not None:
            k = keep.slice(a, b - a)
            piece = [pc.filter(c, k) for c in piece]
        out.append(piece)
        first = last
    return out
