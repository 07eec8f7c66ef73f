"""What a spawn checks before it starts anything: the mesh's name (files are named after it),
its dims and their sizes, the ranks' environment, and that the hosts have room for the ranks.
Each refusal is a ``ValueError`` or ``TypeError`` that says what to type instead; nothing here
starts, changes or remembers anything.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping

from ..runtime import PID_MAX_LIMIT, Shortfall, config, controller_files_shortfall, host_shortfall
from .shape import check_dim

# A mesh's name becomes part of file names (detached meshes' records and logs, merged
# profiles): letters, digits, '_', '.' and '-', not starting like an option or a hidden file.
MESH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
OVERRIDE = "spawn_procs(..., check_limits=False) or MONARCH_KERNEL_CHECK_LIMITS=0 skips this check"


def mesh_name_problem(name) -> str | None:
    """What is wrong with ``name`` as a mesh's name, or None (the one rule for the API, the
    ``%mesh`` magics and detached meshes' records)."""
    if not isinstance(name, str):
        return f"a mesh's name is a string, not {type(name).__name__}"
    if not MESH_NAME.fullmatch(name):
        return (f"{name[:80]!r} cannot name a mesh: files are named after it, so it takes 1 to 64 ASCII letters, "
                f"digits, '_', '.' and '-', and starts with a letter, a digit or '_'")
    return None


def check_mesh_name(name, where: str = "spawn_procs(name=...)") -> str:
    problem = mesh_name_problem(name)
    if problem is None:
        return name
    raise (TypeError if not isinstance(name, str) else ValueError)(f"{where}: {problem}, e.g. name='trainers'")


def check_per_host(per_host, *, on_job: bool) -> tuple[tuple[str, int], ...]:
    """``per_host`` as the mesh's dims, checked (a job's meshes get ``hosts`` in front)."""
    if per_host is None:
        return (("procs", 1),)
    if not isinstance(per_host, Mapping):
        raise TypeError(f"per_host takes a dict of dim -> size, e.g. per_host={{'gpus': 4}}; got {per_host!r:.80}")
    for k, v in per_host.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"per_host={{{k!r}: {v!r}}}: sizes must be positive ints, e.g. per_host={{'gpus': 4}}")
        check_dim(k, f"per_host={{{k!r}: {v!r}}}")
    if on_job and "hosts" in per_host:
        raise ValueError("per_host names a dim 'hosts', which a job's mesh has already (one per host, first); "
                         "name the ranks of each host otherwise, e.g. per_host={'gpus': 4}")
    return tuple(per_host.items())


def check_env(env) -> dict[str, str]:
    """``env`` for the ranks, checked: names and values are strings an environment can hold."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"env takes a dict of str -> str, e.g. env={{'OMP_NUM_THREADS': '1'}}; got {env!r:.80}")
    for k, v in env.items():
        if not isinstance(k, str):
            raise TypeError(f"env: the name {k!r:.80} is of type {type(k).__name__}; names are strings, "
                            f"e.g. env={{'OMP_NUM_THREADS': '1'}}")
        if not k or "=" in k or "\0" in k or not _encodes(k):
            raise ValueError(f"env: {k[:80]!r} cannot name an environment variable: a name is not empty and holds no "
                             f"'=', NUL byte or character the file system's encoding cannot write; "
                             f"e.g. env={{'OMP_NUM_THREADS': '1'}}")
        if not isinstance(v, str):
            raise TypeError(f"env[{k!r}] is {v!r:.80}, of type {type(v).__name__}; environment values are strings: "
                            f"env={{{k!r}: {str(v)[:80]!r}}}")
        if "\0" in v:
            raise ValueError(f"env[{k!r}] holds a NUL byte at {v.index(chr(0))}, which no environment variable can "
                             f"hold (the C string ends there); remove it")
        if not _encodes(v):
            raise ValueError(f"env[{k!r}] holds a character the file system's encoding "
                             f"({sys.getfilesystemencoding()}) cannot write, so no environment variable can hold it")
    return dict(env)


def _encodes(text: str) -> bool:
    try:
        text.encode(sys.getfilesystemencoding(), "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def size_of(dims) -> int:
    return math.prod(size for _, size in dims)


def check_room(per_host: dict, per_host_n: int, hosts: int, *, local: bool, check: bool, per_template: int) -> None:
    """Refuse a spawn of ``per_host_n`` ranks on each of ``hosts`` hosts the controller can
    see cannot hold them: on this host (``local``) its memory and process limits, and the
    controller's open files in any case.  Other hosts check their own memory and process
    limits when asked for ports (``Launcher.spawn``).  More ranks on one host than Linux runs
    tasks are refused even when ``check`` is False."""
    if per_host_n > PID_MAX_LIMIT:
        raise ValueError(f"spawn_procs(per_host={per_host!r}): {per_host_n:,} ranks on one host is more than any "
                         f"Linux host runs processes ({PID_MAX_LIMIT:,}, the largest pid_max); spawn fewer, "
                         f"e.g. per_host={{'gpus': 4}}")
    if not check:
        return
    shortfall = None
    if local:
        shortfall = host_shortfall(per_host_n, config.rank_memory())
        if shortfall is None:
            zmq = not config.get("datagrams")
            shortfall = controller_files_shortfall(0 if zmq else per_host_n, per_host_n if zmq else 0,
                                                   -(-per_host_n // max(1, per_template)))
    else:
        shortfall = controller_files_shortfall(0, per_host_n * hosts, 0)
        if shortfall is not None:
            shortfall = Shortfall(shortfall.limit, shortfall.fits // hosts, shortfall.why)
    if shortfall is not None:
        raise refusal(per_host, per_host_n, shortfall, "")


def refusal(per_host: dict, per_host_n: int, shortfall: Shortfall, host: str) -> ValueError:
    """The error for a spawn a host has no room for, with how many ranks fit and the override."""
    where = f"{host} has room" if host else "there is room"
    fits = f"{where} for {shortfall.fits:,} more ranks per host, not {per_host_n:,}"
    if shortfall.fits > 0 and len(per_host) == 1:
        fits += f"; e.g. per_host={{{next(iter(per_host))!r}: {shortfall.fits}}}"
    override = f".  If you know better, {OVERRIDE}" if shortfall.limit != "ports" else ""
    return ValueError(f"spawn_procs(per_host={per_host!r}) refused before starting anything: {shortfall.why}. So "
                      f"{fits}{override}")
