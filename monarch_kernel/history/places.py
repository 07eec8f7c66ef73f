"""Where histories live: ``history_root()`` (the ``history_dir`` setting, else the XDG state
folder), one folder per mesh or job name under it, one per run (one spawn) under that, one
per host under that, each 0700: ``root/<mesh>/<run>/<host>/``.  A host only ever writes under
its own folder, so a shared file system needs no locking.  The layout before runs
(``root/<mesh>/<host>/``) is still read, as one run named ``legacy``."""

from __future__ import annotations

import calendar
import json
import os
import pathlib
import re
import secrets
import socket
import time

from ..runtime.hosting import config, private_files

META = "meta.json"  # in each host's folder: what the listing says of it
LEGACY = "legacy"  # the one run of a folder written before runs (root/<mesh>/<host>/)
ALL = "all"  # run=ALL: every run of a name, each row with its run
_RUN = re.compile(r"^\d{8}T\d{6}\.\d{3}Z-[0-9a-f]+$")


def history_root() -> pathlib.Path:
    """The folder that holds every history of this user (the ``history_dir`` setting,
    ``MONARCH_KERNEL_HISTORY_DIR``); not made here.

    Example::

        monarch_kernel.history_root()   # PosixPath('/home/me/.local/state/monarch-kernel/history')
    """
    given = config.get("history_dir")
    if given:
        return pathlib.Path(given).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return pathlib.Path(state) / "monarch-kernel" / "history"


def hosts_env(run: str | None = None) -> dict[str, str]:
    """The history settings in force here, as environment variables for a job's ranks: their
    hosts' agents adopt them (``host_side``), so every host writes its history where this
    process does, or none when it writes none; and ``run``, the spawn's run, which every host
    writes that mesh's history under."""
    env = {config.env_name("record_history"): "1" if config.get("record_history") else "0",
           config.env_name("history_dir"): str(history_root())}
    if run is not None:
        env[config.env_name("history_run")] = run
    return env


def new_run(now: float | None = None) -> str:
    """A fresh run id: its UTC start time to the millisecond, then a short random, so that
    ids sort by time and two spawns in one millisecond (on two machines) still differ.

    >>> new_run(0.0)[:19]
    '19700101T000000.000'
    """
    now = time.time() if now is None else now
    ms = int(now * 1000) % 1000
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{ms:03d}Z-{secrets.token_hex(3)}"


def run_started(run: str) -> float | None:
    """When run ``run`` began (epoch seconds, from its id); None for one not named by ``new_run``.

    >>> run_started(new_run(1.5))
    1.5
    """
    stamp, _sep, _random = run.partition("Z-")
    try:
        whole, _dot, ms = stamp.partition(".")
        return calendar.timegm(time.strptime(whole, "%Y%m%dT%H%M%S")) + int(ms) / 1000
    except ValueError:
        return None


def is_run(name: str) -> bool:
    """Whether folder ``name`` (under a mesh's) is a run's (else an old layout's host folder)."""
    return bool(_RUN.match(name))


def host_name() -> str:
    return socket.gethostname()


def safe(name: str) -> str:
    """``name`` as one folder name: no separators, no leading dot."""
    return re.sub(r"[^A-Za-z0-9_.@+-]", "_", name).lstrip(".") or "_"


def host_dir(root: pathlib.Path, mesh: str, run: str, host: str) -> pathlib.Path:
    """``root/mesh/run/host``, made 0700 (and the folders above it) if missing."""
    path = root / safe(mesh) / safe(run) / safe(host)
    for folder in (root, root / safe(mesh), path.parent, path):
        private_files.private_dir(str(folder), parents=False)
    return path


def runs_of(mesh_folder: pathlib.Path) -> dict[str, list[pathlib.Path]]:
    """run -> its host folders, of the mesh (or job) whose folder is ``mesh_folder``; the
    old layout's host folders (a ``meta.json`` of their own) as the run ``LEGACY``."""
    out: dict[str, list[pathlib.Path]] = {}
    try:
        children = [c for c in mesh_folder.iterdir() if c.is_dir() and not c.name.startswith(".")]
    except OSError:  # gone meanwhile, or not ours to read
        return out
    for child in children:
        if is_run(child.name):
            try:
                out[child.name] = [h for h in child.iterdir() if h.is_dir() and not h.name.startswith(".")]
            except OSError:
                continue
        elif (child / META).is_file():
            out.setdefault(LEGACY, []).append(child)
    return out


def host_folders(root: pathlib.Path, host: str) -> list[tuple[str, str]]:
    """(mesh folder's name, folder) of every folder ``host`` wrote under ``root``, every mesh
    and run, the old layout's too: what its size cap counts.  Read with ``scandir``, looking
    up the host's folder in each run rather than listing it: a history of a thousand runs is
    read in milliseconds (paths as strings: a ``pathlib.Path`` each cost as much again)."""
    name = safe(host)
    out: list[tuple[str, str]] = []
    for mesh in _folders(str(root)):
        for child in _folders(mesh.path):
            if is_run(child.name):
                folder = os.path.join(child.path, name)
                if os.path.isdir(folder):
                    out.append((mesh.name, folder))
            elif child.name == name and os.path.isfile(os.path.join(child.path, META)):
                out.append((mesh.name, child.path))  # the old layout's
    return out


def _folders(path: str) -> list[os.DirEntry]:
    """The folders in ``path``, hidden ones left out; none if it cannot be read."""
    try:
        with os.scandir(path) as entries:
            return [e for e in entries if not e.name.startswith(".") and e.is_dir()]
    except OSError:  # gone meanwhile, or not ours to read
        return []


def latest_run(root: pathlib.Path, mesh: str) -> str | None:
    """The newest run of ``mesh`` under ``root`` (by its id, which sorts by time), or None."""
    runs = [r for r in runs_of(root / safe(mesh)) if r != LEGACY]
    return max(runs) if runs else None


def read_meta(folder: pathlib.Path) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return {}


def meta_of(mesh: str, run: str, old: dict, info: dict, host: str, pid: int) -> dict:
    """A host folder's meta.json: ``old`` updated with ``info`` (what the listing says of the
    run), and who wrote it when."""
    now = time.time()
    meta = dict(old)
    meta.setdefault("name", mesh)
    meta.setdefault("run", run)
    meta.setdefault("kind", "mesh")
    meta.setdefault("first", now)
    meta.update(info, last=now, host=host, pid=pid)
    return meta


def write_first_meta(folder: pathlib.Path, meta: dict) -> bool:
    """Give ``folder`` its meta.json if it has none yet (one a converter wrote meanwhile, newer,
    is never replaced); whether this one is it."""
    tmp = folder / f".{META}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)
    try:
        os.link(tmp, folder / META)  # at once, and only where there is none
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def write_meta(folder: pathlib.Path, meta: dict) -> None:
    """Replace ``folder``'s meta.json at once (a reader never sees half of it)."""
    tmp = folder / f".{META}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, folder / META)
