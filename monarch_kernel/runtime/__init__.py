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

from typing import TYPE_CHECKING

from .lazy import lazy_names

if TYPE_CHECKING:
    # isort: off
    # how a package's names are loaded on first use (this door's, the hosting door's, the API's)
    from .lazy import lazy_names as lazy_names
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
        ActorError as ActorError, MeshStopped as MeshStopped, PortTaken as PortTaken, ProcessDied as ProcessDied,
        SendFailed as SendFailed,
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
    from .spawn.rank_output import SYNC_MARK as SYNC_MARK
    from .wire import rejects as rejects
    # isort: on


__getattr__, __dir__ = lazy_names(__name__, __file__)
