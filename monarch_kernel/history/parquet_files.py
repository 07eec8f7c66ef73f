"""One host's history on disk: batches of rows written as one Parquet file per view and mesh,
small files merged as they pile up, and past the host's size cap (``history_max_bytes``) the
oldest files dropped first, recorded as a ``history_dropped`` event.

Its user is whoever does the disk work: the controller's writer process
(``writer_process``) or a host agent's writer thread; pyarrow loads on the first write,
there, never in a controller.
"""

from __future__ import annotations

import collections
import os
import pathlib
import time
from dataclasses import dataclass, field

from ..runtime.hosting import SYNC_PATTERN
from . import places
from .columns import row_columns, schema

MERGE_AT = 32  # this many small files of one view and mesh are merged into one
SMALL_BYTES = 4 << 20  # a file under this (and under a 64th of the cap) is small: merged with others


@dataclass
class Batch:
    """What a writer gathered since its last batch, and where it goes (plain values, so that
    it can be pickled to the writer process)."""

    root: str
    host: str
    max_bytes: int
    pid: int  # the recording process's (the listing tells a live history by it)
    metas: dict[str, dict] = field(default_factory=dict)  # mesh -> what the listing says of it
    chunks: dict[str, list] = field(default_factory=dict)  # mesh -> chunks of lines (``lines``)
    rows: dict[tuple[str, str], list] = field(default_factory=dict)  # (view, mesh) -> rows

    def empty(self) -> bool:
        return not self.metas and not self.chunks and not any(self.rows.values())


class ParquetFiles:
    """Batches in, Parquet files out, under ``root/<mesh>/<host>/``."""

    def __init__(self):
        self.root: pathlib.Path | None = None
        self.host = ""
        self.max_bytes = 0
        self._seq = 0
        self._small: dict[tuple[str, str], list[pathlib.Path]] = collections.defaultdict(list)
        self._bytes: int | None = None  # this host's history, all meshes (counted on the first write)

    def write(self, batch: Batch) -> None:
        root = pathlib.Path(batch.root)
        if root != self.root or batch.host != self.host:  # the settings moved it: count afresh
            self.root, self.host, self._bytes = root, batch.host, None
            self._small.clear()
        self.max_bytes = batch.max_bytes
        for mesh, info in batch.metas.items():
            self._write_meta(mesh, info, batch.pid)
        for mesh, got in batch.chunks.items():
            for piece in _pieces(got, max(64 << 10, self.max_bytes // 16)):
                self._write("lines", mesh, _columns(piece))
        for (view, mesh), rows in batch.rows.items():
            if rows:
                self._write(view, mesh, list(zip(*rows, strict=True)))
        self._cap()

    def _write(self, view: str, mesh: str, cols: list) -> None:
        """One file of ``view``'s rows for ``mesh``, given as columns (``row_columns`` order)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        assert self.root is not None
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
        folder = places.host_dir(self.root, mesh, self.host)
        path = self._write_file(folder, view, table, pq)
        if path.stat().st_size >= min(SMALL_BYTES, self.max_bytes // 64):
            return  # merged with others it could outgrow the cap, which would drop the newest rows with it
        self._small[(view, mesh)].append(path)
        if len(self._small[(view, mesh)]) >= MERGE_AT:
            self._merge(view, mesh, folder, pq)

    def _write_file(self, folder: pathlib.Path, view: str, table, pq) -> pathlib.Path:
        self._seq += 1
        name = f"{view}-{time.time_ns()}-{os.getpid()}-{self._seq}.parquet"
        tmp = folder / f".{name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.chmod(tmp, 0o600)
        os.replace(tmp, folder / name)  # readers glob *.parquet: never half a file
        size = (folder / name).stat().st_size
        if self._bytes is not None:
            self._bytes += size
        return folder / name

    def _merge(self, view: str, mesh: str, folder: pathlib.Path, pq) -> None:
        """Small files of one view become one (queries open fewer files); the new file takes
        the first one's place in time, so the oldest still go first."""
        import pyarrow as pa

        small, self._small[(view, mesh)] = self._small[(view, mesh)], []
        there = [p for p in small if p.exists()]
        if not there:
            return
        table = pa.concat_tables([pq.read_table(p) for p in there])
        merged = self._write_file(folder, view, table, pq)
        first = there[0].name.split("-")[1]
        final = folder / f"{view}-{first}-{os.getpid()}-m{self._seq}.parquet"
        os.replace(merged, final)
        for p in there:
            size = p.stat().st_size
            p.unlink()
            if self._bytes is not None:
                self._bytes -= size

    def _write_meta(self, mesh: str, info: dict, pid: int) -> None:
        assert self.root is not None
        folder = places.host_dir(self.root, mesh, self.host)
        meta = places.read_meta(folder)
        now = time.time()
        meta.setdefault("name", mesh)
        meta.setdefault("kind", "mesh")
        meta.setdefault("first", now)
        meta.update(info, last=now, host=self.host, pid=pid)
        places.write_meta(folder, meta)

    # ------------------------------------------------------------ the size cap

    def _host_files(self) -> list[tuple[int, pathlib.Path, int]]:
        """(time written, path, bytes) of every history file of this host, all meshes."""
        out: list[tuple[int, pathlib.Path, int]] = []
        if self.root is None or not self.root.is_dir():
            return out
        host = places.safe(self.host)
        for mesh in self.root.iterdir():
            folder = mesh / host
            if not folder.is_dir():
                continue
            for p in folder.glob("*.parquet"):
                try:
                    out.append((int(p.name.split("-")[1]), p, p.stat().st_size))
                except (ValueError, IndexError, OSError):
                    continue
        return out

    def _cap(self) -> None:
        if self._bytes is None:
            self._bytes = sum(size for _t, _p, size in self._host_files())
        if self._bytes <= self.max_bytes:
            return
        files = sorted(self._host_files())
        total = sum(size for _t, _p, size in files)
        goal = int(self.max_bytes * 0.9)
        dropped: dict[str, list[str]] = collections.defaultdict(list)
        freed = 0
        for _t, path, size in files:
            if total - freed <= goal:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            freed += size
            dropped[path.parent.parent.name].append(path.name)
            for small in self._small.values():
                if path in small:
                    small.remove(path)
        self._bytes = total - freed
        now = time.time_ns() // 1000
        for mesh, names in dropped.items():  # said at once, in a file of its own
            detail = (f"{len(names)} oldest file(s) dropped to keep this host's history under "
                      f"{self.max_bytes:,} bytes (history_max_bytes): {', '.join(names[:20])}")
            self._write("events", mesh, [[now], [self.host], [None], ["history_dropped"], [None], [None], [detail]])


def _pieces(chunks: list, most: int) -> list[list]:
    """Chunks of lines in pieces of about ``most`` bytes, a file each: the size cap drops a
    long batch's oldest lines, never all of them with the newest."""
    out: list[list] = [[]]
    size = 0
    for chunk in chunks:
        if size >= most and out[-1]:
            out.append([])
            size = 0
        out[-1].append(chunk)
        size += len(chunk[4])
    return out


def _columns(chunks: list) -> list:
    """The ``lines`` view's columns (time, rank, stream, cell, line) of chunks of whole lines,
    as arrow arrays, cut and spread by arrow's kernels: nothing here costs per line."""
    import itertools

    import pyarrow as pa
    import pyarrow.compute as pc

    blobs = pa.array([c[4] for c in chunks], pa.binary())
    try:
        text = blobs.cast(pa.string())
    except pa.ArrowInvalid:  # not UTF-8 somewhere: those chunks decoded as the notebook shows them
        text = pa.array([c[4].decode("utf-8", "replace") for c in chunks], pa.string())
    parts = pc.split_pattern(pc.utf8_slice_codeunits(text, 0, -1), "\n")  # each chunk ends in a newline
    lines = pc.utf8_rtrim(pc.list_flatten(parts), characters="\r")
    ends = pa.array(list(itertools.accumulate(pc.list_value_length(parts).to_pylist())), pa.int32())
    out = []
    for i, typ in enumerate((pa.int64(), pa.int32(), pa.string(), pa.string())):
        values = pa.array([c[i] for c in chunks], typ)
        out.append(pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(ends, values)))
    marked = pc.match_substring_regex(lines, SYNC_PATTERN)
    if pc.any(marked).as_py():  # a cell's end marker is the console's, not a line the rank printed
        lines = pc.replace_substring_regex(lines, SYNC_PATTERN, "")
        keep = pc.invert(pc.and_(marked, pc.equal(pc.utf8_length(lines), 0)))
        out = [pc.filter(column, keep) for column in out]
        lines = pc.filter(lines, keep)
    out.append(lines)
    return out
