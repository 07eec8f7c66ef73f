"""The histories on disk: one record per run (one spawn) of a mesh or job, from its hosts'
``meta.json`` files; a folder of the layout before runs is one run, ``legacy``.  It reads
nothing but those small files (no Parquet), so listing is quick, once what is spooled is
converted (nothing, but where a recorder was killed or its writer is behind); a folder it
cannot read is left out, never a failure of the listing."""

from __future__ import annotations

import datetime
import os
import pathlib
from dataclasses import dataclass, field

from . import places
from .convert import convert


@dataclass
class HistoryRecord:
    """One run's history: ``name``, ``run`` (its id: its UTC start, then a random; ``legacy``
    for a folder written before runs), ``kind`` ("mesh" or "job"), ``hosts``, ``first`` (epoch
    seconds: when it began; a ``legacy`` folder's first write) and ``last`` (its last write),
    ``state`` ("running", "ended", "failed", "gone": its writer died before it ended), ``ranks``
    and its ``folder``."""

    name: str
    run: str
    kind: str
    hosts: list[str]
    first: float
    last: float
    state: str
    ranks: int | None
    folder: pathlib.Path = field(repr=False)

    @property
    def mesh_folder(self) -> pathlib.Path:
        """The folder of every run of this name."""
        return self.folder if self.run == places.LEGACY else self.folder.parent

    def to_json(self) -> dict:
        return {"name": self.name, "run": self.run, "kind": self.kind, "hosts": self.hosts, "first": _iso(self.first),
                "last": _iso(self.last), "state": self.state, "ranks": self.ranks, "folder": str(self.folder)}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def alive(pid: int | None, host: str | None) -> bool:
    """Whether process ``pid`` of ``host`` lives (another host's: assumed so)."""
    if not pid or host != places.host_name():
        return True  # another host's writer: trust what it wrote
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_histories(root=None) -> list[HistoryRecord]:
    """Every run's history under ``root`` (default ``history_root()``), the latest started first.

    Example::

        [(r.name, r.run, r.state) for r in monarch_kernel.history.list_histories()]
    """
    root = pathlib.Path(root) if root is not None else places.history_root()
    convert(root)  # what is spooled (a run whose rows are all there yet is listed too)
    out: list[HistoryRecord] = []
    try:
        meshes = [m for m in root.iterdir() if m.is_dir() and not m.name.startswith(".")]
    except OSError:
        return out
    for mesh in meshes:
        for run, hosts in places.runs_of(mesh).items():
            record = _record(mesh, run, hosts)
            if record is not None:
                out.append(record)
    out.sort(key=lambda r: (r.first, r.last), reverse=True)
    return out


def _record(mesh: pathlib.Path, run: str, host_folders: list[pathlib.Path]) -> HistoryRecord | None:
    metas = [m for m in (places.read_meta(h) for h in host_folders) if isinstance(m, dict) and m]
    if not metas:
        return None
    try:
        hosts = sorted({str(h) for m in metas for h in (m.get("hosts") or [m.get("host")]) if h})
        # a state is the controller's word (a job's agents write none): running until it says otherwise
        said = [m for m in metas if "state" in m] or metas
        states = [m.get("state", "running") for m in said]
        state = "running" if "running" in states else ("failed" if "failed" in states else states[0])
        if state == "running" and not any(alive(m.get("pid"), m.get("host")) for m in said
                                          if m.get("state", "running") == "running"):
            state = "gone"
        return HistoryRecord(
            name=str(metas[0].get("name", mesh.name)), run=run,
            kind="job" if any(m.get("kind") == "job" for m in metas) else "mesh",
            # when it began: its id says (a mesh's first rows may be written after a later run's)
            hosts=hosts, first=min([float(m.get("first", 0.0)) for m in metas]
                                   + [t for t in [places.run_started(run)] if t is not None]),
            last=max(float(m.get("last", 0.0)) for m in metas), state=str(state),
            ranks=max((int(m.get("ranks") or 0) for m in metas), default=None) or None,
            folder=mesh if run == places.LEGACY else mesh / run)
    except (TypeError, ValueError):  # a meta.json not of ours: that run is not listed
        return None
