"""A job's history brought home: the controller asks each host's agent for the files it wrote
(over the job's own signed, encrypted links: ``runtime.host_files``) and copies them under
this host's history root, one folder per run and host as there, skipping files it already has.  Done
when a history is opened, when a mesh on other hosts ends, and before a job is killed, so the
history outlives the allocation.  Never asks anything of a host that is not the job's."""

from __future__ import annotations

import logging
import os
import pathlib
import threading

from ..runtime.hosting import Runtime, host_files
from . import places

log = logging.getLogger(__name__)
GATHER_TIMEOUT = 30.0  # for every host's files of one mesh together

_busy: list[threading.Thread] = []  # gathers running on their own threads
_lock = threading.Lock()


def _links(rt: Runtime, mesh: str | None) -> dict[str, list]:
    """mesh name -> the live agent links of its ranks (meshes on other hosts this process spawned)."""
    out: dict[str, list] = {}
    for om in rt.owned_meshes():
        if om.links is not None and (mesh is None or om.ref.name == mesh):
            alive = [link for link in om.links if link.alive]
            if alive:
                out.setdefault(om.ref.name, []).extend(alive)
    return out


def gather(mesh: str | None = None, root: pathlib.Path | None = None, timeout: float = GATHER_TIMEOUT) -> int:
    """Copy the history files of ``mesh`` (None: every mesh on other hosts this process
    spawned) from their hosts into ``root`` (default ``history_root()``); the files copied."""
    rt = Runtime.existing()
    if rt is None:
        return 0
    root = root or places.history_root()
    copied = 0
    for name, links in _links(rt, mesh).items():
        have = [f"{p.parent.parent.name}/{p.name}" for p in (root / places.safe(name)).glob("*/*/*.parquet")]
        done = host_files.fetch(rt, links, name, have)
        if not done.wait(timeout) or done.error() is not None:
            log.warning("monarch_kernel: the history of %s could not be fetched from its hosts within %g s",
                        name, timeout)
            continue
        for where, files in done.result().items():
            if not where:
                for host, why in files:
                    log.warning("monarch_kernel: the history of %s on %s: %s", name, host, why.decode())
                continue
            run, _, host = where.partition("/")
            if not (places.is_run(run) and host and host == places.safe(host)):
                log.warning("monarch_kernel: the history of %s: an agent sent files of %r, not RUN/HOST", name,
                            where[:100])
                continue
            folder = places.host_dir(root, name, run, host)
            for file_name, data in files:
                if "/" in file_name or file_name.startswith("."):
                    continue  # only plain names of that folder
                tmp = folder / f".{file_name}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, folder / file_name)
                copied += file_name != places.META
    return copied


def gather_soon(mesh: str) -> None:
    """``gather(mesh)`` on a thread of its own (from the IO thread: a mesh on other hosts ended)."""
    thread = threading.Thread(target=_gather_quietly, args=(mesh,), name="monarch-history-gather", daemon=True)
    with _lock:  # started before it is listed: ``copy_home`` may join it at once
        thread.start()
        _busy[:] = [t for t in _busy if t.is_alive()] + [thread]


def _gather_quietly(mesh: str) -> None:
    try:
        gather(mesh)
    except Exception as e:  # noqa: BLE001  (a history not copied is said, never a failure of the mesh)
        log.warning("monarch_kernel: the history of %s could not be copied home: %r", mesh, e)


def copy_home(timeout: float = GATHER_TIMEOUT) -> None:
    """Before a job ends: wait for the gathers under way, then copy every mesh's history home."""
    with _lock:
        busy = list(_busy)
    for thread in busy:
        thread.join(timeout)
    _gather_quietly_all(timeout)


def _gather_quietly_all(timeout: float) -> None:
    try:
        gather(None, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        log.warning("monarch_kernel: the job's history could not be copied home: %r", e)
