"""The spool (``spool_files``) into Parquet (``parquet_files``): every batch pending under a
root, oldest first.  Done by a writer process at the lowest CPU priority as batches come
(``writer_process``), and by whoever reads before it reads (a query, the listing, a host
agent asked for its files), at its own priority.  Two may convert one batch at once: each
builds its files without a lock; the first to take the batch's lock puts them in place and
removes it, the other throws its own away.  pyarrow loads only when there is a batch."""

from __future__ import annotations

import logging
import os
import pathlib
import threading

from . import spool_files
from .parquet_files import Batch, ParquetFiles

log = logging.getLogger(__name__)
BAD = ".bad"  # a spooled batch that cannot be read is renamed so, and said once, not retried


class Converter:
    """Converts spooled batches; keeps, per root and host, the files it wrote (to merge them)."""

    def __init__(self, committing: threading.Lock | None = None):
        self._files: dict[tuple[str, str], ParquetFiles] = {}
        self._lock = threading.Lock()
        self._committing = committing or threading.Lock()  # held while files are put in place

    def convert(self, root, host: str | None = None) -> int:
        """Every batch spooled under ``root`` (by ``host``; None: by any) so far; how many."""
        done = 0
        with self._lock:
            for path in spool_files.pending(root, host):
                done += self._one(path)
        return done

    def _one(self, path: pathlib.Path) -> bool:
        with spool_files.opened(path) as f:
            if f is None:
                return False  # converted by another meanwhile
            try:
                batch: Batch = spool_files.read(f)
            except Exception as e:  # noqa: BLE001  (an unreadable file must not stop the rest: set aside, said)
                log.warning("monarch_kernel: a spooled history batch %s cannot be read (%r): kept as %s%s",
                            path, e, path.name, BAD)
                os.replace(path, path.with_name(path.name + BAD))
                return False
            batch.root = str(path.parents[2])  # where it is now (a shared folder may be mounted elsewhere)
            files = self._files.setdefault((batch.root, batch.host), ParquetFiles())
            files.staging = path.parent  # a converter ended while it builds leaves nothing in the runs' folders
            files.guard = self._committing
            staged = files.stage(batch)
            there = False
            try:
                with self._committing, spool_files.committing(f) as there:
                    if there:
                        files.commit(staged)
                        os.unlink(path)
            finally:
                if not there:
                    staged.discard()
        if there:
            files.settle()
        return there


_converter = Converter()


def convert(root, host: str | None = None) -> int:
    """Convert what is spooled under ``root`` now (before reading it), in this process."""
    if not spool_files.pending(root, host):
        return 0
    return _converter.convert(root, host)
