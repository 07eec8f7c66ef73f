"""The per-job copy of a synced workspace on one host, and the actor that keeps it.

Files arrive as bytes in endpoint arguments and are written atomically into a private
(0700) directory under the host's temp dir, named after the job, so every rank of the job
on that host shares one copy and other jobs never see it.  The copy goes first on the
rank's ``sys.path`` and changed modules are re-imported.  Runs on ranks; it never reads the
controller's filesystem (``workspace.py`` is the controller's half).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import threading

from ...runtime import Runtime, private_files
from ..actor import Actor, current_rank
from ..controllers import PORT_NAME
from ..endpoint import endpoint

JOB_DIR_PREFIX = "monarch-workspace-"
TMP_PREFIX = ".mk-partial-"  # a file being written; a leftover of an interrupted sync is removed
NEVER_RELOADED = ("monarch_kernel", "__main__", "__mp_main__")  # the runtime itself, and scripts

# copy dir -> {relative path: sha256} this process last re-imported against (a module-level
# table: a fresh WorkspaceCopy actor is spawned for each sync).
_seen: dict[str, dict[str, str]] = {}
_seen_lock = threading.Lock()


def job_id() -> str:
    """Names this job the same in every one of its processes, and nobody else can: the root
    controller's address (which each rank inherits in its launch config) under the job's key.
    (A digest of the address alone could be computed by anyone from /tmp and ``ps``, and the
    folder made first, denying the sync.)"""
    rt = Runtime.current()
    root = rt.job_ports.get(PORT_NAME, (None, 0))[0] or (rt.address if rt.owner is None else rt.owner)
    return rt.job_name("workspace", root)


def job_dir() -> str:
    """This host's directory of this job's workspace copies (not created here)."""
    return os.path.join(tempfile.gettempdir(), JOB_DIR_PREFIX + job_id())


def remove_job_dir(path: str) -> None:
    """Remove ``path``, a ``job_dir()`` of this user (the root controller does, at exit)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def _private_dir() -> str:
    """The job's folder, this user's alone (0700, its parents checked too)."""
    return private_files.private_dir(job_dir())


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"a workspace copy is named by one plain path component, not {name!r}")
    return name


def _inside(copy: str, rel: str) -> str:
    """``rel`` (a '/'-separated relative path) as a path inside ``copy``; anything that could
    leave it (absolute, '..', empty parts) is refused."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") or "\x00" in p or os.sep in p for p in parts):
        raise ValueError(f"refusing workspace path {rel!r}: it must be relative and stay inside the copy")
    return os.path.join(copy, *parts)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class _Copy:
    """One workspace's copy on this host: the files, its record, and its lock."""

    def __init__(self, name: str):
        self.job = _private_dir()
        self.dir = os.path.join(self.job, _check_name(name))
        self.record_path = os.path.join(self.job, name + ".manifest.json")
        self.lock_path = os.path.join(self.job, name + ".lock")
        os.makedirs(self.dir, exist_ok=True)

    @contextlib.contextmanager
    def locked(self):
        """Held while the copy is scanned or written: ranks of this job on this host (of any
        of its meshes) may sync at once."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def record(self) -> dict[str, list]:
        """{rel: [size, mtime_ns, sha256]} as last written; {} if missing or unreadable."""
        try:
            with open(self.record_path) as f:
                got = json.load(f)
            return got if isinstance(got, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self, record: dict[str, list]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.job, prefix=TMP_PREFIX)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.record_path)

    def digests(self) -> dict[str, str]:
        return {rel: entry[2] for rel, entry in self.record().items()}

    def scan(self) -> dict[str, str]:
        """{rel: sha256} of the files in the copy now: the record's digest where size and
        mtime still match, the file's own otherwise (and the record is brought up to date)."""
        with self.locked():
            old = self.record()
            new: dict[str, list] = {}
            for root, dirs, files in os.walk(self.dir):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for fname in files:
                    path = os.path.join(root, fname)
                    if fname.startswith(TMP_PREFIX):
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                        continue
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    rel = os.path.relpath(path, self.dir).replace(os.sep, "/")
                    entry = old.get(rel)
                    if not (isinstance(entry, list) and entry[:2] == [st.st_size, st.st_mtime_ns]):
                        entry = [st.st_size, st.st_mtime_ns, _sha256_file(path)]
                    new[rel] = entry
            if new != old:
                self.save(new)
        return {rel: entry[2] for rel, entry in new.items()}

    def apply(self, files: list, delete: list) -> int:
        """Remove ``delete``, then write ``files`` ([rel, bytes, executable]) each by an atomic
        rename; returns the bytes written."""
        written = 0
        with self.locked():
            record = self.record()
            for rel in delete:
                path = _inside(self.dir, rel)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                _drop_bytecode(path)
                record.pop(rel, None)
                self._prune(os.path.dirname(path))
            for rel, data, executable in files:
                path = _inside(self.dir, rel)
                parent = os.path.dirname(path)
                if os.path.isdir(path):  # a folder that became a file: its files were deleted above
                    shutil.rmtree(path)
                os.makedirs(parent, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=TMP_PREFIX)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        os.fchmod(f.fileno(), 0o755 if executable else 0o644)
                    os.replace(tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                _drop_bytecode(path)  # same size within the same second would pass its check
                st = os.stat(path)
                record[rel] = [st.st_size, st.st_mtime_ns, hashlib.sha256(data).hexdigest()]
                written += len(data)
            self.save(record)
        return written

    def _prune(self, folder: str) -> None:
        """Remove folders the deletions left empty (their bytecode caches aside), up to the copy."""
        while folder != self.dir and folder.startswith(self.dir + os.sep):
            try:
                left = [n for n in os.listdir(folder) if n != "__pycache__"]
            except FileNotFoundError:
                left = []
            if left:
                return
            shutil.rmtree(folder, ignore_errors=True)
            folder = os.path.dirname(folder)


def _drop_bytecode(path: str) -> None:
    if path.endswith(".py"):
        with contextlib.suppress(OSError, ValueError):
            os.unlink(importlib.util.cache_from_source(path))


def _on_path(folder: str) -> bool:
    """Put ``folder`` first on ``sys.path`` unless it is already there; True if it was added."""
    if folder in sys.path:
        return False
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    return True


def _relative(module, roots: tuple[str, ...]) -> str | None:
    """The '/'-separated path of ``module``'s file under the first of ``roots`` holding it."""
    f = getattr(module, "__file__", None)
    if not isinstance(f, str):
        return None
    f = os.path.abspath(f)
    for root in roots:
        if root and f.startswith(root + os.sep):
            return os.path.relpath(f, root).replace(os.sep, "/")
    return None


def _never_reloaded(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in NEVER_RELOADED)


def refresh(copy: str, current: dict[str, str], source: str) -> dict:
    """Re-import, in this process, the modules whose files in ``copy`` changed since it last
    did (all of them, the first time), and forget those whose files were deleted.

    A module counts when its file is in the copy, or at the same place under ``source`` (the
    controller's folder, where the ranks share its filesystem): reloading moves it to the
    copy.  Modules are reloaded in ``sys.modules`` order, which is the order their imports
    finished: the modules a module imports (a package's submodules that its ``__init__``
    imports) come before it, so it binds their new names.
    """
    with _seen_lock:
        seen = _seen.get(copy, {})
        _seen[copy] = dict(current)
    changed = {rel for rel, digest in current.items() if seen.get(rel) != digest}
    deleted = set(seen) - set(current)
    importlib.invalidate_caches()
    _on_path(copy)
    targets, dropped = [], []
    for name, module in list(sys.modules.items()):
        if _never_reloaded(name):
            continue
        rel = _relative(module, (copy, source))
        if rel is None:
            continue
        if rel in deleted:
            sys.modules.pop(name, None)  # a later import fails, as it would where the file is gone
            dropped.append(name)
        elif rel in changed and rel.endswith(".py"):
            targets.append(module)
    reloaded, failed = [], {}
    for module in targets:
        try:
            importlib.reload(module)
            reloaded.append(module.__name__)
        except Exception as e:  # noqa: BLE001  (the controller reports it, with every rank's)
            failed[module.__name__] = f"{type(e).__name__}: {e}"
    return {"reloaded": reloaded, "dropped": dropped, "failed": failed}


class WorkspaceCopy(Actor):
    """Keeps this host's copy of a workspace for ``ProcMesh.sync_workspace``."""

    @endpoint
    def prepare(self, name: str, manifest_ranks: list) -> dict:
        """Make the copy and put it first on ``sys.path``; say where it is (``place`` names the
        directory itself: ranks with the same place share one copy), whether this process
        has re-imported against its current files (``stale``), and on ``manifest_ranks`` the
        files it holds."""
        copy = _Copy(name)
        _on_path(copy.dir)
        st = os.stat(copy.job)
        with _seen_lock:
            seen = _seen.get(copy.dir, {})
        out = {"place": f"{_boot_id()}:{st.st_dev}:{st.st_ino}", "host": socket.gethostname(), "dir": copy.dir,
               "stale": copy.digests() != seen}
        if current_rank().rank in manifest_ranks:
            out["manifest"] = copy.scan()
        return out

    @endpoint
    def manifest(self, name: str) -> dict:
        """{rel: sha256} of the copy's files."""
        return _Copy(name).scan()

    @endpoint
    def receive(self, name: str, files: list, delete: list) -> int:
        """Write ``files`` ([rel, bytes, executable]) and remove ``delete``; bytes written."""
        return _Copy(name).apply(files, delete)

    @endpoint
    def refresh(self, name: str, source: str, auto_reload: bool) -> dict:
        """Re-import what changed in the copy (only make new files importable when not
        ``auto_reload``)."""
        copy = _Copy(name)
        if not auto_reload:
            importlib.invalidate_caches()
            return {"reloaded": [], "dropped": [], "failed": {}}
        return refresh(copy.dir, copy.digests(), source)
