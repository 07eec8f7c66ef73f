"""Where histories live: ``history_root()`` (the ``history_dir`` setting, else the XDG state
folder), one folder per mesh or job under it, one per host under that, each 0700.  A host
only ever writes under its own folder, so a shared file system needs no locking."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket

from ..runtime import config, private_files

META = "meta.json"  # in each host's folder: what the listing says of it


def history_root() -> pathlib.Path:
    """The folder that holds every history of this user (the ``history_dir`` setting,
    ``MONARCH_KERNEL_HISTORY_DIR``); not made here."""
    given = config.get("history_dir")
    if given:
        return pathlib.Path(given).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return pathlib.Path(state) / "monarch-kernel" / "history"


def hosts_env() -> dict[str, str]:
    """The history settings in force here, as environment variables for a job's ranks: their
    hosts' agents adopt them (``host_side``), so every host writes its history where this
    process does, or none when it writes none."""
    return {config.env_name("record_history"): "1" if config.get("record_history") else "0",
            config.env_name("history_dir"): str(history_root())}


def host_name() -> str:
    return socket.gethostname()


def safe(name: str) -> str:
    """``name`` as one folder name: no separators, no leading dot."""
    return re.sub(r"[^A-Za-z0-9_.@+-]", "_", name).lstrip(".") or "_"


def host_dir(root: pathlib.Path, mesh: str, host: str) -> pathlib.Path:
    """``root/mesh/host``, made 0700 (and the folders above it) if missing."""
    path = root / safe(mesh) / safe(host)
    private_files.private_dir(str(root), parents=False)
    private_files.private_dir(str(root / safe(mesh)), parents=False)
    private_files.private_dir(str(path), parents=False)
    return path


def read_meta(folder: pathlib.Path) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return {}


def write_meta(folder: pathlib.Path, meta: dict) -> None:
    """Replace ``folder``'s meta.json at once (a reader never sees half of it)."""
    tmp = folder / f".{META}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, folder / META)
