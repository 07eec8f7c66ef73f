"""One host's history writer: rows gathered in memory by whoever records (the IO thread reading
ranks' output, hooks), written by its own thread as one Parquet file per view and mesh per
batch, so a rank's print path only appends to a list.  It never blocks a recorder on disk.

Rotation is by file: each batch is a file, small files are merged as they pile up, and past
the host's size cap (``history_max_bytes``) the oldest files go first, recorded as a
``history_dropped`` event.  pyarrow loads on the first write, on this thread.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import threading
import time

from ..runtime import config
from . import places
from .columns import VIEWS, row_columns, schema

log = logging.getLogger(__name__)

BATCH_ROWS = 100_000  # a batch this long is written at once, without waiting for the interval
BATCH_BYTES = 16 << 20  # ... and lines of this many bytes
MERGE_AT = 32  # this many small files of one view and mesh are merged into one


class HistoryWriter:
    """Rows in, Parquet files out, under ``root/<mesh>/<host>/``."""

    def __init__(self, root: pathlib.Path, host: str, *, flush_s: float, max_bytes: int):
        self.root, self.host = root, host
        self.flush_s, self.max_bytes = flush_s, max_bytes
        self.cell: str | None = None  # the cell or call lines are recorded under
        self.live = False  # whether root and limits follow the settings (``new_writer``)
        self._dirty: set[str] = set()  # meshes whose info changed since the last batch
        self._rows: dict[tuple[str, str], list] = {}
        self._chunks: dict[str, list] = {}  # mesh -> chunks of lines (``lines``)
        self._pending = 0  # bytes of lines in _chunks
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._write_lock = threading.Lock()  # one batch at a time (the thread, flush())
        self._seq = 0
        self._small: dict[tuple[str, str], list[pathlib.Path]] = collections.defaultdict(list)
        self._bytes: int | None = None  # this host's history, all meshes (counted on the first write)
        self._meta: dict[str, dict] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="monarch-history", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ from any thread, never blocking

    def add(self, view: str, mesh: str, row: tuple) -> None:
        """One row of ``view`` for ``mesh``, its values in ``row_columns(view)``'s order."""
        with self._lock:
            rows = self._rows.get((view, mesh))
            if rows is None:
                rows = self._rows[(view, mesh)] = []
            rows.append(row)
        if len(rows) >= BATCH_ROWS:
            self._wake.set()

    def lines(self, mesh: str, rank: int, stream: str, lines: bytes) -> None:
        """A chunk of a rank's whole lines (each ended by a newline), stamped with this moment:
        one append, however many lines; they are cut on the writer's thread, in arrow's C++."""
        chunk = (time.time_ns() // 1000, rank, stream, self.cell, lines)
        with self._lock:
            chunks = self._chunks.get(mesh)
            if chunks is None:
                chunks = self._chunks[mesh] = []
            chunks.append(chunk)
            self._pending += len(lines)
        if self._pending >= BATCH_BYTES:
            self._wake.set()

    def mesh_info(self, mesh: str, **info) -> None:
        """What the listing says of ``mesh`` (kind, hosts, state), written with the next batch."""
        with self._lock:
            self._meta.setdefault(mesh, {}).update(info)
            self._dirty.add(mesh)
        self._wake.set()

    # ------------------------------------------------------------ writing

    def flush(self) -> None:
        """Write what is gathered now (a query in this process sees every row recorded before it)."""
        with self._write_lock:
            self._follow_settings()
            with self._lock:
                batches, self._rows = self._rows, {}
                chunks, self._chunks, self._pending = self._chunks, {}, 0
                dirty, self._dirty = self._dirty, set()
                metas = {m: dict(self._meta.get(m, {})) for m in dirty | {m for _v, m in batches} | set(chunks)}
            for mesh in metas:
                self._write_meta(mesh, metas.get(mesh, {}))
            for mesh, got in chunks.items():
                self._write("lines", mesh, _columns(got))
            for (view, mesh), rows in batches.items():
                if rows:
                    self._write(view, mesh, list(zip(*rows, strict=True)))
            self._cap()

    def _follow_settings(self) -> None:
        """A writer made by ``new_writer`` follows the settings as they change (a test, a user
        pointing ``history_dir`` elsewhere): the next batch goes to the new place."""
        if not self.live:
            return
        root = places.history_root()
        if root != self.root:
            self.root, self._bytes = root, None
            self._small.clear()
        self.flush_s, self.max_bytes = config.get("history_flush"), config.get("history_max_bytes")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._wake.set()
            self._thread.join(timeout=10)
            self.flush()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001  (a full disk must not end the thread: say it, go on)
                log.warning("monarch_kernel: the history could not be written under %s: %r", self.root, e)

    def _write(self, view: str, mesh: str, cols: list) -> None:
        """One file of ``view``'s rows for ``mesh``, given as columns (``row_columns`` order)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

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

    def _write_meta(self, mesh: str, info: dict) -> None:
        folder = places.host_dir(self.root, mesh, self.host)
        meta = places.read_meta(folder)
        now = time.time()
        meta.setdefault("name", mesh)
        meta.setdefault("kind", "mesh")
        meta.setdefault("first", now)
        meta.update(info, last=now, host=self.host, pid=os.getpid())
        places.write_meta(folder, meta)

    # ------------------------------------------------------------ the size cap

    def _host_files(self) -> list[tuple[int, pathlib.Path, int]]:
        """(time written, path, bytes) of every history file of this host, all meshes."""
        out: list[tuple[int, pathlib.Path, int]] = []
        if not self.root.is_dir():
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
        for mesh, names in dropped.items():
            self.add("events", mesh, (now, self.host, None, "history_dropped", None, None,
                                      f"{len(names)} oldest file(s) dropped to keep this host's history under "
                                      f"{self.max_bytes:,} bytes (history_max_bytes): {', '.join(names[:20])}"))


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
    out.append(lines)
    return out


def new_writer(root: pathlib.Path | None = None, host: str | None = None) -> HistoryWriter:
    """A writer with the settings in force, for ``host`` (default: this host's name)."""
    writer = HistoryWriter(root or places.history_root(), host or places.host_name(),
                           flush_s=config.get("history_flush"), max_bytes=config.get("history_max_bytes"))
    writer.live = root is None
    return writer


__all__ = ["HistoryWriter", "new_writer", "VIEWS"]
