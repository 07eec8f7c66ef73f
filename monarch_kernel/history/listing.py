"""The histories on disk: one record per mesh or job, from its hosts' ``meta.json`` files.
Reads only, and nothing but those small files (no Parquet), so listing is quick."""

from __future__ import annotations

import datetime
import os
import pathlib
from dataclasses import dataclass, field

from . import places


@dataclass
class HistoryRecord:
    """One history: ``name``, ``kind`` ("mesh" or "job"), ``hosts``, ``first``/``last`` (epoch
    seconds of its first and last write), ``state`` ("running", "ended", "failed", "gone":
    its writer died before it ended), ``ranks`` and its ``folder``."""

    name: str
    kind: str
    hosts: list[str]
    first: float
    last: float
    state: str
    ranks: int | None
    folder: pathlib.Path = field(repr=False)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "hosts": self.hosts, "first": _iso(self.first),
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
    """Every history under ``root`` (default ``history_root()``), most recent first."""
    root = pathlib.Path(root) if root is not None else places.history_root()
    out: list[HistoryRecord] = []
    if not root.is_dir():
        return out
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        metas = [places.read_meta(h) for h in folder.iterdir() if h.is_dir()]
        metas = [m for m in metas if m]
        if not metas:
            continue
        hosts = sorted({h for m in metas for h in (m.get("hosts") or [m.get("host")]) if h})
        states = [m.get("state", "running") for m in metas]
        state = "running" if "running" in states else ("failed" if "failed" in states else states[0])
        if state == "running" and not any(alive(m.get("pid"), m.get("host")) for m in metas
                                          if m.get("state", "running") == "running"):
            state = "gone"
        out.append(HistoryRecord(
            name=metas[0].get("name", folder.name),
            kind="job" if any(m.get("kind") == "job" for m in metas) else "mesh",
            hosts=hosts, first=min(m.get("first", 0.0) for m in metas), last=max(m.get("last", 0.0) for m in metas),
            state=state, ranks=max((m.get("ranks") or 0 for m in metas), default=None) or None, folder=folder))
    out.sort(key=lambda r: r.last, reverse=True)
    return out
