"""The engine under the public API (internal): processes, sockets, messages, calls.  It never
imports the layers above it.  Its rooms, by the process that runs each, and its two doors are
drawn in docs/how-it-works.md.

This module is the main door: what the actor, kernel and data layers (and every layer above
runtime/ but agent/ and job/) may import, ``from ..runtime import X``.  Agents and jobs come
in by the second door, ``runtime/hosting.py``.  Past the names, they use the methods of
``Runtime`` (front_door.py, local_door.py), ``rt.io`` and ``rt.hooks``; a part's state is never
a name here.  tests/system/test_layering.py checks both doors.

The names are written once, as the imports under ``TYPE_CHECKING`` below: type checkers read
them there, and ``lazy_names`` reads the same lines to load each name's module when it is
first asked for (PEP 562), so importing this package imports nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # isort: off
    # the process: its runtime, who is running, its settings, its log's handler of last resort,
    # folders and files of this user's alone
    from . import config as config
    from . import diagnostics as diagnostics
    from . import private_files as private_files
    from .completion import Completion as Completion
    from .context import (
        MeshRef as MeshRef, actor_path as actor_path, current_actor as current_actor, new_actor_id as new_actor_id,
        process_mesh as process_mesh,
    )
    from .process import Runtime as Runtime

    # records and errors: what a failure or a death says, the runtime's exceptions, rank lists
    # as text, and whether a host has room for more ranks
    from .errors import (
        ActorError as ActorError, MeshStopped as MeshStopped, ProcessDied as ProcessDied, SendFailed as SendFailed,
    )
    from .failure import DeathInfo as DeathInfo, MeshFailure as MeshFailure, RemoteFailure as RemoteFailure
    from .rank_sets import (
        RankSpecError as RankSpecError, counted as counted, parse_ranks as parse_ranks, rank_label as rank_label,
    )
    from .spawn.capacity import (
        PID_MAX_LIMIT as PID_MAX_LIMIT, NoRoom as NoRoom, Shortfall as Shortfall,
        controller_files_shortfall as controller_files_shortfall, host_shortfall as host_shortfall,
    )
    from .spawn.restart_policy import RestartPolicy as RestartPolicy

    # what an actor call is made of: the envelope's enums, the payloads, pickling, the marks the
    # server looks for on an actor's endpoints, the shared-memory segments of large arguments
    from .calls.actor_slots import (
        CONCURRENT_MARK as CONCURRENT_MARK, ENDPOINT_MARK as ENDPOINT_MARK, RESTART_HOOK as RESTART_HOOK,
        STOP_METHOD as STOP_METHOD,
        in_actor_event_loop as in_actor_event_loop,
    )
    from .wire import segments as segments
    from .wire.curve import CurveKeys as CurveKeys
    from .wire.envelope import Kind as Kind, Mode as Mode, Part as Part, Status as Status
    from .wire.payloads import CallInfo as CallInfo, SpawnInfo as SpawnInfo
    from .wire.serialize import describe_unpicklable as describe_unpicklable, dumps as dumps, dumps_plain as dumps_plain
    from .wire.unpickling import loads as loads

    # looking at processes and hosts, each a module: which host this is, which GPU a rank uses,
    # input refused (counted), a rank's CPU and memory, its threads' stacks, its log records
    from . import gpus as gpus
    from . import rank_logging as rank_logging
    from .net import hosts as hosts
    from .spawn import proc_stats as proc_stats
    from .spawn import stack_dump as stack_dump
    from .wire import rejects as rejects
    # isort: on


def lazy_names(door: str, path: str) -> tuple[Any, Any]:
    """``(__getattr__, __dir__)`` for the door module ``door`` (its ``__name__``) whose source
    is ``path``: the names its ``if TYPE_CHECKING:`` block imports, each loaded on first use.
    ``__all__`` is asked of ``__getattr__`` too.  (scientific Python's ``lazy_loader`` reads a
    stub file the same way.)"""
    table: dict[str, tuple[str, str]] = {}  # name -> (module to import from, its name there)

    def read() -> dict[str, tuple[str, str]]:
        if not table:
            import ast
            import importlib.util

            with open(path, encoding="utf-8") as f:
                source = f.read()
            for block in ast.parse(source).body:
                if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING":
                    for node in block.body:
                        assert isinstance(node, ast.ImportFrom), f"{path}: only 'from . import' lines in the door"
                        here = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                        table.update({a.asname or a.name: (here, a.name) for a in node.names})
        return table

    package = door if path.endswith("__init__.py") else door.rpartition(".")[0]

    def __getattr__(name: str) -> Any:
        import importlib
        import sys

        if name == "__all__":
            return sorted(read())
        if name not in read():
            raise AttributeError(f"module {door!r} has no attribute {name!r}")
        where, there = table[name]
        if where == door:  # a module of this package: ``from . import config``
            value: Any = importlib.import_module(f"{where}.{there}")
        else:  # as ``from where import there`` would: a name of that module, else its submodule
            module = importlib.import_module(where)
            value = getattr(module, there) if hasattr(module, there) else importlib.import_module(f"{where}.{there}")
        setattr(sys.modules[door], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(read())

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_names(__name__, __file__)
