"""One process's history writer: rows gathered in memory by whoever records (the IO thread
reading ranks' output, hooks), handed as a ``Batch`` by its own thread to where the disk work
is done, so a rank's print path only appends to a list.  It never blocks a recorder on disk.

Where the batches go is its sink: in a controller (the kernel, a user's script) and a host
agent, the spool on disk, converted to Parquet by a writer process of its own at the lowest
priority (``writer_process``), so that the recorder never loads pyarrow and the ranks beside
it pay next to nothing; elsewhere (``InProcess``), ``ParquetFiles`` on the writer's thread.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import pathlib
import threading
import time
from typing import Protocol

from ..runtime.hosting import config
from . import places
from .columns import VIEWS
from .parquet_files import Batch, ParquetFiles, Place

log = logging.getLogger(__name__)

BATCH_ROWS = 100_000  # a batch this long is written at once, without waiting for the interval
BATCH_BYTES = 16 << 20  # ... and lines of this many bytes
HOLD_S = config.seconds("history_hold")  # samples alone wait this long to be written
_TAKEN = object()  # put behind the chunks a flush takes: what comes after waits for the next
_PLACE = operator.itemgetter(1)  # a recorded chunk's (mesh, run)


class Sink(Protocol):
    """Where a writer's batches go: ``write(batch, wait)`` (``batch`` None: nothing new; ``wait``:
    return once every batch given so far is on disk, spooled or converted), ``close()`` (no wait)."""

    def write(self, batch: Batch | None, wait: bool) -> None: ...

    def close(self) -> None: ...


class InProcess:
    """The sink that writes on the calling thread (a host agent's writer)."""

    def __init__(self):
        self.files = ParquetFiles()

    def write(self, batch: Batch | None, wait: bool) -> None:
        if batch is not None:
            self.files.write(batch)

    def close(self) -> None:
        pass


class HistoryWriter:
    """Rows in, batches out to ``sink`` (default: Parquet files written in this process)."""

    def __init__(self, root: pathlib.Path, host: str, *, flush_s: float, max_bytes: int,
                 sink: Sink | None = None):
        self.root, self.host = root, host
        self.flush_s, self.max_bytes = flush_s, max_bytes
        self.sink: Sink = sink if sink is not None else InProcess()
        self.cell: str | None = None  # the cell or call lines are recorded under
        self.live = False  # whether root and limits follow the settings (``new_writer``)
        # mesh name -> the run its rows go to (``begin_run``); a name not there: its newest run
        # on disk (an attached mesh's, spawned by another process); ``controller``: this process's
        self._runs: dict[str, str] = {"controller": places.new_run()}
        self._places: dict[str, Place] = {}  # mesh -> (mesh, its run now): one tuple shared by its chunks
        self._dirty: set[Place] = set()  # meshes whose info changed since the last batch
        self._rows: dict[tuple[str, str, str | None], list] = {}  # (view, mesh, run) -> rows
        # chunks of lines (``lines``), appended without a lock: a deque's append and popleft
        # are each atomic, and only ``flush`` (under _write_lock) takes them out
        self._lines: collections.deque[object] = collections.deque()
        self._pending = 0  # bytes of lines in _lines (about: counted without a lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._write_lock = threading.Lock()  # one batch at a time (the thread, flush())
        self._meta: dict[Place, dict] = {}
        self._held_since: float | None = None  # when samples alone began to wait (``_samples_only``)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="monarch-history", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ from any thread, never blocking

    def begin_run(self, mesh: str, run: str | None = None) -> str:
        """From now on ``mesh``'s rows go to run ``run`` (default: a new one, for a spawn); the run."""
        run = places.safe(run) if run else places.new_run()
        with self._lock:
            self._runs[mesh] = run
            self._places[mesh] = (mesh, run)
        return run

    def run_of(self, mesh: str) -> str | None:
        """The run ``mesh``'s rows go to now, if this process knows it."""
        return self._runs.get(mesh)

    def add(self, view: str, mesh: str, row: tuple) -> None:
        """One row of ``view`` for ``mesh``, its values in ``row_columns(view)``'s order."""
        with self._lock:
            key = (view, mesh, self._runs.get(mesh))
            rows = self._rows.get(key)
            if rows is None:
                rows = self._rows[key] = []
            rows.append(row)
        if len(rows) >= BATCH_ROWS:
            self._wake.set()

    def lines(self, mesh: str, rank: int, stream: str, lines: bytes) -> None:
        """A chunk of a rank's whole lines (each ended by a newline), stamped with this moment
        and the run it goes to: one append, however many lines, and no lock (it runs on the IO
        thread for every chunk); they are cut where the batch is written, in arrow's C++."""
        place = self._places.get(mesh) or self._place(mesh)
        self._lines.append((time.time_ns() // 1000, place, rank, stream, self.cell, lines))
        self._pending += len(lines)
        if self._pending >= BATCH_BYTES:
            self._wake.set()

    def _place(self, mesh: str) -> Place:
        with self._lock:
            return self._places.setdefault(mesh, (mesh, self._runs.get(mesh)))

    def mesh_info(self, mesh: str, **info) -> None:
        """What the listing says of ``mesh`` (kind, hosts, state), written with the next batch."""
        with self._lock:
            place = (mesh, self._runs.get(mesh))
            self._meta.setdefault(place, {}).update(info)
            self._dirty.add(place)

    # ------------------------------------------------------------ writing

    def flush(self, wait: bool = True, *, hold_samples: bool = False) -> None:
        """Hand over what is gathered now; with ``wait``, return once it is on disk (a query in
        this process, which converts the spool first, sees every row recorded before it).
        ``hold_samples`` (the periodic flush): what is gathered is only the periodic samples,
        younger than ``history_hold`` seconds: they wait, so that an idle mesh starts no writer
        process every few seconds."""
        with self._write_lock:
            self._follow_settings()
            with self._lock:
                if hold_samples and self._samples_only():
                    self.sink.write(None, wait)
                    return
                self._held_since = None
                rows, self._rows = self._rows, {}
                dirty, self._dirty = self._dirty, set()
                # every chunk recorded before a mesh_info now in ``dirty`` (a run "ended") goes with it
                self._pending = 0
                self._lines.append(_TAKEN)
                lines: list = list(iter(self._lines.popleft, _TAKEN))  # in C, while the IO thread appends behind
                chunks = _by_place(lines)
                metas = {p: dict(self._meta.get(p, {})) for p in dirty | {(m, r) for _v, m, r in rows} | set(chunks)}
            batch = Batch(str(self.root), self.host, self.max_bytes, os.getpid(), metas, chunks, rows)
            self.sink.write(None if batch.empty() else batch, wait)

    def _samples_only(self) -> bool:
        """Whether only samples are gathered, the oldest younger than ``HOLD_S`` (under the lock)."""
        if not self._rows or self._lines or self._dirty or any(key[0] != "samples" for key in self._rows):
            return False
        if self._held_since is None:
            self._held_since = time.monotonic()
        return time.monotonic() - self._held_since < HOLD_S

    def _follow_settings(self) -> None:
        """A writer made by ``new_writer`` follows the settings as they change (a test, a user
        pointing ``history_dir`` elsewhere): the next batch goes to the new place."""
        if not self.live:
            return
        self.root = places.history_root()
        self.flush_s, self.max_bytes = config.get("history_flush"), config.get("history_max_bytes")

    def close(self) -> None:
        """The last batch handed over, without waiting for it to be written."""
        if not self._closed:
            self._closed = True
            self._wake.set()
            self._thread.join(timeout=10)
            self.flush(wait=False)
            self.sink.close()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            try:
                self.flush(wait=False, hold_samples=True)
            except Exception as e:  # noqa: BLE001  (a full disk must not end the thread: say it, go on)
                log.warning("monarch_kernel: the history could not be written under %s: %r", self.root, e)


def _by_place(lines: list) -> dict[Place, list]:
    """Recorded chunks ``(time, (mesh, run), rank, stream, cell, bytes)`` by their place, in
    order, as they are (the converter drops the place): no loop here when they have one."""
    if not lines:
        return {}
    got: dict[Place, list] = {}
    if len(found := set(map(_PLACE, lines))) == 1:
        return {found.pop(): lines}
    for chunk in lines:
        got.setdefault(_PLACE(chunk), []).append(chunk)
    return got


def new_writer(root: pathlib.Path | None = None, host: str | None = None, *, own_process: bool = False
               ) -> HistoryWriter:
    """A writer with the settings in force, for ``host`` (default: this host's name); with
    ``own_process``, its batches are written by a writer process of its own (a controller's)."""
    sink = None
    if own_process:
        from .writer_process import WriterProcess

        sink = WriterProcess()
    writer = HistoryWriter(root or places.history_root(), host or places.host_name(),
                           flush_s=config.get("history_flush"), max_bytes=config.get("history_max_bytes"), sink=sink)
    writer.live = root is None
    return writer


__all__ = ["HistoryWriter", "new_writer", "VIEWS"]
