"""``ProcMesh.sync_workspace``: a local folder's changed files, sent to every host of a mesh
and re-imported on its ranks.

The controller's half: it lists the folder (``scan``), asks one rank per host what that
host's copy holds, sends only what differs, as bytes in ordinary endpoint calls over the
mesh's own connection, then has every rank re-import.  It never assumes a rank can read the
controller's files; ``workspace_copy.py`` is the ranks' half.
"""

from __future__ import annotations

import atexit
import fnmatch
import hashlib
import os
import re
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...runtime import MeshStopped, ProcessDied, Runtime, rank_label
from ..errors import WorkspaceReloadError
from . import workspace_copy
from .workspace_copy import WorkspaceCopy

if TYPE_CHECKING:
    from ..proc_mesh import ProcMesh

MAX_FILE_SIZE = 8 << 20  # larger files are skipped (data, checkpoints), and the summary says so
MAX_TOTAL = 512 << 20  # a folder holding more is refused: sync a smaller one
MAX_FILES = 50_000
CHUNK = 32 << 20  # bytes per endpoint call to a host
SKIPPED_DIRS = ("__pycache__", "node_modules")
SKIPPED_FILES = ("*.pyc", "*.pyo")

# abs path -> (size, mtime_ns, ctime_ns, inode, sha256): a file is hashed again only when it changed
_digests: dict[str, tuple[int, int, int, int, str]] = {}
_cleanup_registered = threading.Event()


@dataclass
class LocalFiles:
    """A folder's files as ``scan`` found them: ``files`` maps each '/'-separated relative
    path to ``(size, sha256, executable)``; ``skipped`` lists ``(path, why)``."""

    root: str
    files: dict[str, tuple[int, str, bool]]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def scan(root: str, exclude: Iterable[str] = (), max_file_size: int = MAX_FILE_SIZE) -> LocalFiles:
    """The files of ``root`` that a sync sends.  Left out: names starting with '.' (``.git``,
    ``.venv``, ``.ipynb_checkpoints``...), ``__pycache__``, ``node_modules``, any folder
    holding ``pyvenv.cfg`` (a virtual environment), ``*.pyc``, links to folders, anything
    that is not a regular file, names matching an ``exclude`` pattern (fnmatch, against the
    name or the relative path), and files over ``max_file_size`` bytes (listed as skipped)."""
    root = os.path.abspath(root)
    patterns = tuple(exclude)
    out = LocalFiles(root, {})
    total = 0

    def excluded(name: str, rel: str) -> bool:
        return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)

    for folder, dirs, names in os.walk(root):
        base = os.path.relpath(folder, root).replace(os.sep, "/")
        prefix = "" if base == "." else base + "/"
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                         and not excluded(d, prefix + d)
                         and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg")))
        for name in sorted(names):
            rel = prefix + name
            if name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in SKIPPED_FILES) or excluded(name, rel):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue  # a dangling link, or gone since the listing
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size > max_file_size:
                out.skipped.append((rel, f"{_size(st.st_size)}, over the {_size(max_file_size)} limit "
                                          "(max_file_size=)"))
                continue
            total += st.st_size
            if total > MAX_TOTAL or len(out.files) >= MAX_FILES:
                raise ValueError(f"{root} holds more than {_size(MAX_TOTAL)} or {MAX_FILES} files to sync; "
                                 "sync the folder of your code instead, or leave data out with exclude=[...]")
            out.files[rel] = (st.st_size, _digest(path, st), bool(st.st_mode & 0o100))
    return out


def _digest(path: str, st: os.stat_result) -> str:
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    got = _digests.get(path)
    if got is not None and got[:4] == key:
        return got[4]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    _digests[path] = (*key, h.hexdigest())
    return h.hexdigest()


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def copy_name(root: str) -> str:
    """The copy's folder name in the job's directory: the folder's name and a digest of its
    whole path, so two folders with the same name stay apart."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(root.rstrip(os.sep))).lstrip(".") or "root"
    return f"{base}-{hashlib.sha256(root.encode()).hexdigest()[:8]}"


@dataclass
class HostSync:
    """What one sync did on one host (one shared copy): the files sent and removed, how many
    were already there, and the modules its ranks re-imported (``failed``: those that
    raised, with the rank)."""

    host: str
    directory: str
    ranks: list[int]
    sent: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0
    reloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        line = (f"{self.host} {rank_label(self.ranks)} {self.directory}: {len(self.sent)} sent "
                f"({_size(self.bytes_sent)}), {len(self.deleted)} deleted, {self.unchanged} unchanged")
        if self.reloaded:
            line += f"; reloaded {', '.join(self.reloaded)}"
        for what, why in self.failed.items():
            line += f"\n    re-importing {what} failed: {why}"
        return line


@dataclass
class WorkspaceSync:
    """The result of ``ProcMesh.sync_workspace``: one ``HostSync`` per host; ``skipped``
    lists files left out as too large, with why; ``dead_ranks`` were not reached."""

    path: str
    hosts: list[HostSync]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    dead_ranks: list[int] = field(default_factory=list)

    @property
    def files_sent(self) -> int:
        return sum(len(h.sent) for h in self.hosts)

    @property
    def bytes_sent(self) -> int:
        return sum(h.bytes_sent for h in self.hosts)

    @property
    def deleted(self) -> int:
        return sum(len(h.deleted) for h in self.hosts)

    def __str__(self) -> str:
        n = len(self.hosts)
        lines = [f"synced {self.path} to {n} host{'s' if n != 1 else ''}:"]
        lines += [f"  {h}" for h in self.hosts]
        lines += [f"  skipped {rel}: {why}" for rel, why in self.skipped]
        if self.dead_ranks:
            lines.append(f"  not reached: {rank_label(self.dead_ranks)} (dead)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"WorkspaceSync({self.path!r}, {len(self.hosts)} host(s): {self.files_sent} sent "
                f"({_size(self.bytes_sent)}), {self.deleted} deleted)")


def sync_workspace(procs: ProcMesh, path=None, *, auto_reload: bool = True, exclude: Iterable[str] = (),
                   max_file_size: int = MAX_FILE_SIZE, timeout: float = 60.0) -> WorkspaceSync:
    """Make each host's copy of ``path`` (default: the current directory) match it, put the
    copy first on every rank's ``sys.path`` and re-import changed modules there."""
    root = os.path.abspath(os.fspath(path) if path is not None else os.getcwd())
    if not os.path.isdir(root):
        raise NotADirectoryError(f"sync_workspace takes a folder; {root!r} is not one")
    if isinstance(max_file_size, bool) or not isinstance(max_file_size, int) or max_file_size < 0:
        raise ValueError(f"max_file_size takes a number of bytes, not {max_file_size!r}")
    if isinstance(exclude, str):
        exclude = (exclude,)
    if procs.stopped:
        raise MeshStopped(f"mesh '{procs.name}' was stopped; spawn a new mesh to sync a workspace to")
    local = scan(root, exclude, max_file_size)
    name = copy_name(root)
    _remove_copies_at_exit()
    ranks = list(procs.shape.ranks)
    hosts = procs.ref.hosts
    dead = set(procs.dead_ranks())
    asked: dict[str, int] = {}  # one rank per host (as the mesh knows hosts) lists its copy
    for r in ranks:
        if r not in dead:
            asked.setdefault(hosts[r] if hosts else "", r)
    copies = procs.spawn("workspace_copy", WorkspaceCopy)
    flat = copies.flatten("rank")

    def one(r: int):
        return flat.slice(rank=ranks.index(r))

    try:
        answers, gone = _answers(copies.prepare.call(name, sorted(asked.values())), ranks, timeout)
        dead |= gone
        places: dict[str, list[int]] = {}
        for r in sorted(answers):
            places.setdefault(answers[r]["place"], []).append(r)
        # Hosts as the ranks see their copy: the directory itself, not a host name, decides.
        held: dict[str, tuple[int, dict | None]] = {}
        for place, members in places.items():
            have = [r for r in members if "manifest" in answers[r]]
            held[place] = (have[0], answers[have[0]]["manifest"]) if have else (members[0], None)
        late = {p: one(r).manifest.call_one(name) for p, (r, m) in held.items() if m is None}
        for p, fut in late.items():
            held[p] = (held[p][0], fut.get(timeout=timeout))
        summary = WorkspaceSync(root, [], list(local.skipped), sorted(dead))
        plans, by_place = {}, {}  # by place: hosts' copies share one path, on different machines
        for place, members in places.items():
            r, listed = held[place]
            remote = listed or {}
            send = [rel for rel, (_s, digest, _x) in local.files.items() if remote.get(rel) != digest]
            delete = sorted(rel for rel in remote if rel not in local.files)
            by_place[place] = HostSync(answers[r]["host"], answers[r]["dir"], members, send,
                                       sum(local.files[rel][0] for rel in send), delete, len(local.files) - len(send))
            summary.hosts.append(by_place[place])
            plans[place] = (r, send, delete)
        _send(root, local, plans, name, one, timeout)
        touched = {p for p, (_r, send, delete) in plans.items() if send or delete}
        again = [r for r in sorted(answers) if answers[r]["place"] in touched or answers[r]["stale"]]
        if again:
            results = _refresh(copies, one, again, ranks, dead, (name, root, auto_reload), timeout)
            for r, res in results.items():
                h = by_place[answers[r]["place"]]
                h.reloaded = sorted(set(h.reloaded) | set(res["reloaded"]))
                for module, why in res["failed"].items():
                    h.failed[f"{module} (rank {r})"] = why
    finally:
        copies.stop()  # not waited for: the sync is done either way
    failures = [f"{what}: {why}" for h in summary.hosts for what, why in h.failed.items()]
    if failures:
        raise WorkspaceReloadError(f"synced {root}, but re-importing failed on the ranks:\n  " + "\n  ".join(failures)
                                   + "\nfix the file and sync again", summary)
    return summary


def _answers(fut, ranks: list[int], timeout: float) -> tuple[dict[int, dict], set[int]]:
    """Every rank's answer to a call on all of them; ranks that died are left out (and returned)."""
    try:
        values = list(fut.get(timeout=timeout).values())
    except ProcessDied as e:
        results = getattr(e, "results", None)
        if results is None:
            raise
        values = list(results.values())
        for v in values:
            if isinstance(v, BaseException) and not isinstance(v, ProcessDied):
                raise v from None
    answers = {r: v for r, v in zip(ranks, values, strict=True) if not isinstance(v, BaseException)}
    return answers, {r for r, v in zip(ranks, values, strict=True) if isinstance(v, BaseException)}


def _send(root: str, local: LocalFiles, plans: dict, name: str, one, timeout: float) -> None:
    """Send each host its files in calls of at most ``CHUNK`` bytes (hosts in parallel, each
    host's calls in order); deletions go with the first."""
    data: dict[str, bytes] = {}

    def read(rel: str) -> bytes:
        if rel not in data:
            with open(os.path.join(root, *rel.split("/")), "rb") as f:
                data[rel] = f.read()
        return data[rel]

    batches: dict[str, list[list[str]]] = {}
    for place, (_r, send, delete) in plans.items():
        if not send and not delete:
            continue
        chunks: list[list[str]] = [[]]
        size = 0
        for rel in send:
            n = local.files[rel][0]
            if chunks[-1] and size + n > CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(rel)
            size += n
        batches[place] = chunks
    step = 0
    while True:
        futs = []
        for place, chunks in batches.items():
            if step < len(chunks):
                r, _send_list, delete = plans[place]
                files = [[rel, read(rel), local.files[rel][2]] for rel in chunks[step]]
                futs.append(one(r).receive.call_one(name, files, delete if step == 0 else []))
        if not futs:
            return
        for f in futs:
            f.get(timeout=timeout)
        step += 1


def _refresh(copies, one, again: list[int], ranks: list[int], dead: set[int], args: tuple,
             timeout: float) -> dict[int, dict]:
    if len(again) == len(ranks) and not dead:
        answers, _gone = _answers(copies.refresh.call(*args), ranks, timeout)
        return answers
    futs = {r: one(r).refresh.call_one(*args) for r in again}
    out = {}
    for r, f in futs.items():
        try:
            out[r] = f.get(timeout=timeout)
        except ProcessDied:
            continue
    return out


def _remove_copies_at_exit() -> None:
    """The job's root controller removes the job's copies on its own host when it exits
    (other hosts' copies stay in their temp directories)."""
    if Runtime.current().owner is None and not _cleanup_registered.is_set():
        _cleanup_registered.set()
        atexit.register(workspace_copy.remove_job_dir, workspace_copy.job_dir())
