"""The engine under the public API (internal): processes, sockets, messages, calls.  It never
imports the layers above it.

Its layers, lowest first.  A module imports only from its own layer or below; the exceptions
are lazy or for types only, and are named.  tests/test_layering.py checks that no two rooms
(sub-packages) import each other.

  leaves         config, context, completion, limits, diagnostics, failure (plain records),
                 errors (the runtime's exceptions), rank_sets (rank lists as text)
  wire/          the bytes between processes: envelope and kinds, typed payloads, signing
                 (auth), framing, the optional C codec (native, _wire), Curve keys, pickling
                 (serialize) and shared-memory segments.  Imports only config.
  spawn/         processes coming and going: the launcher and launch_config, the template's
                 client, channel and fork, host agents' messages and channel, workers, the
                 process tree, rank output and logging, stack sampling, proc stats.  Stands
                 on wire/.  (template_fork imports rank inside the forked child, lazily.)
  hooks          the runtime's extension points (uses spawn's host messages and rank output)
  net/           messages moving: the IO thread, inboxes, the receiver, the transport,
                 datagrams, unfinished sends, the network, hosts, ports.  Stands on wire/.
  calls/         what a message means: outstanding calls, the caller, the server and its
                 actor slots, the multicast tree and the calls gathering answers through
                 this rank (gathering), supervision, finalize, the main thread.
                 Stands on net/, spawn/ and wire/.  (caller and server name process.Runtime
                 for types only, until each part is given its collaborators.)
  front_door     what the layers above may ask of the parts, as methods of ``Runtime``
  process        ``Runtime``: the composition of the parts, one per process
  rank, template_server   the entry points of a rank and of the template

The front door for the layers above is the names below (``__all__``), the methods of
``Runtime`` (front_door.py), ``rt.io`` and ``rt.hooks``.  Agents, jobs and the data plane also
use the wire formats they speak (spawn/'s host_messages, agent_channel, worker_wire,
worker_key; wire/'s payloads).  Importing this package imports nothing: each name loads its
module when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .completion import Completion
    from .context import MeshRef, actor_path, current_actor, process_mesh
    from .errors import ActorError, MeshStopped, ProcessDied, SendFailed
    from .failure import DeathInfo, MeshFailure, RemoteFailure
    from .process import Runtime
    from .rank_sets import RankSpecError, parse_ranks, rank_label

_WHERE = {
    "Runtime": "process",
    "ActorError": "errors", "ProcessDied": "errors", "SendFailed": "errors", "MeshStopped": "errors",
    "DeathInfo": "failure", "MeshFailure": "failure", "RemoteFailure": "failure",
    "Completion": "completion",
    "MeshRef": "context", "actor_path": "context", "current_actor": "context", "process_mesh": "context",
    "RankSpecError": "rank_sets", "parse_ranks": "rank_sets", "rank_label": "rank_sets",
}

__all__ = [
    "ActorError", "Completion", "DeathInfo", "MeshFailure", "MeshRef", "MeshStopped", "ProcessDied",
    "RankSpecError", "RemoteFailure", "Runtime", "SendFailed", "actor_path", "current_actor", "parse_ranks",
    "process_mesh", "rank_label",
]


def __getattr__(name: str):
    """Load a front-door name's module on first use (PEP 562)."""
    import importlib

    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
