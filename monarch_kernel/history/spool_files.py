"""The history's spool: each batch a recording process gathers is put, as it is (pickled),
in a file of its own under ``root/.spool/<host>/``: about the cost of a copy, with no
pyarrow.  Turning it into Parquet is done later (``convert``): by a writer process at the
lowest CPU priority, when the CPU is idle, and by whoever reads first.  A batch stays here
until its Parquet files are in place, so a process killed at any moment (the recorder,
its writer, both) loses nothing that was spooled; the spool counts toward the size cap.

A file holds two pickles: the places (mesh, run) the batch has rows of and what the
listing is to say of them (what a drop names, read without the rows), then the batch.
Its name, ``<ns>-<pid>-<seq>.batch``, sorts by when it was spooled.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pathlib
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..runtime.hosting import private_files
from . import places

FOLDER = ".spool"
SUFFIX = ".batch"
_seq = itertools.count()


def host_folder(root, host: str) -> pathlib.Path:
    return pathlib.Path(root) / FOLDER / places.safe(host)


def put(batch) -> pathlib.Path:
    """Spool ``batch`` (a ``parquet_files.Batch``); its file.  Written whole, then named:
    a reader never sees half of one."""
    root = pathlib.Path(batch.root)
    folder = host_folder(root, batch.host)
    for f in (root, folder.parent, folder):
        private_files.private_dir(str(f), parents=False)
    name = f"{time.time_ns()}-{os.getpid()}-{next(_seq)}{SUFFIX}"
    tmp = folder / f".{os.getpid()}-{name}.tmp"
    head = pickle.dumps((sorted(_places(batch), key=repr), batch.metas), protocol=pickle.HIGHEST_PROTOCOL)
    body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        for part in (memoryview(head), memoryview(body)):
            while part:
                part = part[os.write(fd, part):]
    finally:
        os.close(fd)
    os.replace(tmp, folder / name)
    return folder / name


def _places(batch) -> set[tuple[str, str | None]]:
    return set(batch.metas) | set(batch.chunks) | {(mesh, run) for _v, mesh, run in batch.rows}


def pending(root, host: str | None = None) -> list[pathlib.Path]:
    """The spooled batches under ``root`` (of ``host``; None: every host's), oldest first."""
    base = pathlib.Path(root) / FOLDER
    try:
        folders = [base / places.safe(host)] if host is not None else [f for f in base.iterdir() if f.is_dir()]
    except OSError:
        return []
    out = []
    for folder in folders:
        try:
            names = os.listdir(folder)
            out += [(int(n.split("-")[0]), folder / n) for n in names if n.endswith(SUFFIX)]
        except (OSError, ValueError):
            continue
        if folder.name == places.safe(places.host_name()):  # pids of this host only
            _sweep(folder, [n for n in names if n.endswith(".tmp")])
    return [p for _t, p in sorted(out)]


def _sweep(folder: pathlib.Path, tmps: list[str]) -> None:
    """Remove the half-written files (``.<pid>-....tmp``) of processes of this host that are
    gone: a recorder killed while it spooled, a converter let go while it built files."""
    for name in tmps:
        try:
            pid = int(name[1:].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(folder / name)
        except (ValueError, OSError):
            continue


def sizes(root, host: str) -> list[tuple[int, pathlib.Path, int]]:
    """(time spooled, path, bytes) of ``host``'s spooled batches (what the size cap counts)."""
    out = []
    for p in pending(root, host):
        try:
            out.append((int(p.name.split("-")[0]), p, p.stat().st_size))
        except (OSError, ValueError):
            continue
    return out


@contextmanager
def opened(path: pathlib.Path) -> Iterator[object]:
    """A spooled batch's file, opened (None: gone already)."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed below)
    except FileNotFoundError:
        yield None
        return
    with f:
        yield f


def read(f) -> Any:
    """The batch in an ``opened`` file."""
    f.seek(0)
    pickle.load(f)  # its places
    return pickle.load(f)


@contextmanager
def committing(f) -> Iterator[bool]:
    """Hold the batch's lock while its files are put in place and it is removed; True if it
    is still there (False: another converter, or the size cap, got there first)."""
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield os.fstat(f.fileno()).st_nlink > 0
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def drop(path: pathlib.Path) -> tuple[list[tuple[str, str | None]], dict]:
    """Remove a spooled batch unconverted (the size cap); the places it had rows of, and
    what the listing was to say of them."""
    with opened(path) as f:
        if f is None:
            return [], {}
        with committing(f) as there:
            if not there:
                return [], {}
            f.seek(0)  # type: ignore[attr-defined]
            try:
                lost, metas = pickle.load(f)  # type: ignore[arg-type]
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError):
                lost, metas = [], {}
            os.unlink(path)
            return list(lost), dict(metas)
