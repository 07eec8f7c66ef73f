"""A host's history under its size cap (``history_max_bytes``, every mesh and run together):
its Parquet files and its spool (batches not converted yet, ``spool``) counted together,
the oldest dropped first, so the oldest run's go first.  Whoever writes keeps it: the
converter after each batch it puts in place, and the recording process after each batch it
spools (it only removes files: no pyarrow).  Each says what it dropped, in the run that
lost it (a ``history_dropped`` event)."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field

from . import places, spool_files

KEEP = 0.9  # past the cap, the oldest files go until this share of it is left


@dataclass
class Dropped:
    """Files one run lost: ``folder``, its host folder, if it has one yet (None: only spooled
    batches of it were dropped), else ``run`` (None: the mesh's newest)."""

    mesh: str
    run: str | None
    folder: pathlib.Path | None
    names: list[str]
    meta: dict = field(default_factory=dict)  # what the listing said of it in the batches dropped

    def detail(self, max_bytes: int) -> str:
        return (f"{len(self.names)} oldest file(s) dropped to keep this host's history under {max_bytes:,} bytes "
                f"(history_max_bytes): {', '.join(self.names[:20])}")


def host_files(root: pathlib.Path, host: str) -> list[tuple[int, pathlib.Path, int]]:
    """(time written, path, bytes) of every history file of ``host``: its Parquet files, all
    meshes and runs, and its spooled batches."""
    out = [(int(name.split("-")[1]), pathlib.Path(path), size) for name, path, size in _parquet_files(root, host)]
    return out + spool_files.sizes(root, host)


def parquet_bytes(root: pathlib.Path, host: str) -> int:
    """The bytes of ``host``'s Parquet files (``host_files`` without its spool, summed: what
    the recording side counts every ``CAP_EVERY_S``, cheaply)."""
    return sum(size for _name, _path, size in _parquet_files(root, host))


def _parquet_files(root: pathlib.Path, host: str) -> list[tuple[str, str, int]]:
    """(name, path, bytes) of ``host``'s Parquet files whose names carry their time."""
    out = []
    for _mesh, folder in places.host_folders(root, host):
        try:
            with os.scandir(folder) as entries:
                files = [e for e in entries if e.name.endswith(".parquet") and not e.name.startswith(".")]
        except OSError:
            continue
        for e in files:
            try:
                int(e.name.split("-")[1])
                out.append((e.name, e.path, e.stat(follow_symlinks=False).st_size))
            except (ValueError, IndexError, OSError):
                continue
    return out


def trim(root: pathlib.Path, host: str, max_bytes: int, spared: pathlib.Path | None = None
         ) -> tuple[int, list[Dropped]]:
    """Drop ``host``'s oldest files until its history holds ``KEEP`` of ``max_bytes``, if
    it holds more than that, but ``spared`` (the batch just spooled: its converter cuts it
    in pieces, of which it keeps the newest); (the bytes it holds then, what each run lost)."""
    files = sorted(host_files(root, host))
    total = sum(size for _t, _p, size in files)
    if total <= max_bytes:
        return total, []
    goal = int(max_bytes * KEEP)
    dropped: dict[tuple, Dropped] = {}
    for _t, path, size in files:
        if total <= goal:
            break
        if path == spared:
            continue
        if path.name.endswith(spool_files.SUFFIX):
            lost, metas = spool_files.drop(path)
            for mesh, run in lost:
                d = dropped.setdefault(("run", mesh, run), Dropped(mesh, run, None, []))
                d.names.append(path.name)
                d.meta.update(metas.get((mesh, run), {}))
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            folder = path.parent
            mesh = places.read_meta(folder).get("name") or (
                folder.parent.parent if places.is_run(folder.parent.name) else folder.parent).name
            dropped.setdefault(("folder", folder), Dropped(mesh, None, folder, [])).names.append(path.name)
        total -= size
    return total, list(dropped.values())
