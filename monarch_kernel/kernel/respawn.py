"""Spawning a mesh's name again, as re-running ``procs = %mesh spawn -n 4`` does: the mesh of
that name is reused when it was spawned with the same options and every rank of it runs, else
it is stopped and replaced; the cell says which.  A second mesh never starts silently beside
the first.  A spawn's name, when ``--name`` and ``--detach`` give none, is the variable the cell
assigns the mesh to (``trainers = %mesh spawn -n 2`` is mesh ``trainers``), else ``procs``.

A detached mesh is never stopped this way: it was made to outlive the kernel, so only
``%mesh stop`` ends it.  Runs in the kernel.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from IPython.core.error import UsageError

from ..actor.spawn_checks import mesh_name_problem
from ..runtime import Runtime, counted

DEFAULT_NAME = "procs"
# ``NAME = %mesh spawn ...`` as a line of a cell (IPython passes the magic only what follows ``%mesh``).
_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*%mesh\s+(.*?)\s*$")
# The options that make two spawns the same mesh: everything but the name.
_NOT_SHAPE = {"name", "detach"}


def spawn_name(args, raw_cell: str, line: str) -> str:
    """The name ``%mesh spawn`` gives its mesh: ``--detach`` or ``--name``, else the variable
    the running cell assigns it to, else ``procs``."""
    if args.detach or args.name:
        return args.detach or args.name
    assigned = assigned_name(raw_cell, line)
    return assigned if assigned is not None and mesh_name_problem(assigned) is None else DEFAULT_NAME


def assigned_name(raw_cell: str, line: str) -> str | None:
    """The variable of the line ``NAME = %mesh LINE`` in ``raw_cell``; None when the cell has
    no such line (the magic was called otherwise)."""
    want = line.split()
    for text in raw_cell.splitlines():
        m = _ASSIGNED.match(text)
        if m is not None and m[2].split() == want:
            return m[1]
    return None


def spawn_key(args) -> tuple:
    """What must match for a spawn to reuse a mesh: every option but the name, as given."""
    return tuple(sorted((k, _frozen(v)) for k, v in vars(args).items() if k not in _NOT_SHAPE))


def _frozen(value):
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


class Respawn:
    """What ``%mesh spawn`` does when its name is taken: ``reuse`` gives the mesh to reuse,
    or stops the old one (through ``stop``, which ends a mesh as ``%mesh stop`` does) and
    gives None for a new one to start.  ``keys`` remembers each mesh's ``spawn_key``."""

    def __init__(self, stop: Callable[[str], object]):
        self.stop = stop
        self.keys: dict[str, tuple] = {}

    def reuse(self, meshes: dict, detached: set, name: str, key: tuple):
        got = meshes.get(name)
        if got is None:
            running = {om.ref.name for om in Runtime.current().owned_meshes() if not om.stopping and om.alive}
            if name in running:  # spawned with the API in a cell: not the magics' to stop
                raise UsageError(f"mesh {name!r} runs already, spawned with spawn_procs in a cell: stop it first "
                                 f"(its ProcMesh's .stop()), or give this one another name: "
                                 f"%mesh spawn ... --name {name}2")
            return None
        procs = got[0]
        why = self._why_not(procs, self.keys.get(name), key)
        if why is None:
            print(f"mesh {name}: reused; its {counted(len(procs), 'rank')} still run, with their namespaces "
                  f"(spawned with the same options; %mesh stop {name} first for fresh ranks)")
            return procs
        if name in detached:
            raise UsageError(f"mesh {name!r} is detached ({why}), and a spawn never stops a detached mesh: "
                             f"%mesh stop {name} first, or give the new mesh another --name")
        self.stop(name)
        print(f"mesh {name}: stopped its {counted(len(procs), 'rank')} ({why}), to start the new ones in its place")
        return None

    def spawned(self, name: str, key: tuple) -> None:
        self.keys[name] = key

    def forget(self, name: str) -> None:
        self.keys.pop(name, None)

    @staticmethod
    def _why_not(procs, had: tuple | None, key: tuple) -> str | None:
        """Why the mesh cannot be reused, or None."""
        if procs.stopped:
            return "it had stopped"
        dead = procs.dead_ranks()
        if dead:
            return f"{counted(len(dead), 'rank')} of it dead"
        if had is None:
            return "it was not spawned by %mesh spawn here"
        if had != key:
            old, new = dict(had), dict(key)
            changed = [f"{_flag(k)} {_said(old.get(k))}, now {_said(new.get(k))}" for k in sorted(set(old) | set(new))
                       if old.get(k) != new.get(k)]
            return "spawned with " + "; ".join(changed)
        return None


def _flag(option: str) -> str:
    return "-n" if option == "n" else "--" + option.replace("_", "-")


def _said(value) -> str:
    """An option's value as the user gave it: ``4``, ``none``, ``A=1 B=2``."""
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return " ".join("=".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
    return str(value)
