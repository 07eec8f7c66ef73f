"""The engine under the public API (internal): processes, sockets, messages, calls.  It never
imports the layers above it.

Its layers, lowest first.  A module imports only from its own layer or below; the exceptions
are lazy or for types only, and are named.  tests/system/test_layering.py checks that no
two rooms (sub-packages) import each other.

  leaves         config, context, completion, limits, diagnostics, failure (plain records),
                 errors (the runtime's exceptions), rank_sets (rank lists as text),
                 private_files (folders and files of this user's alone), gpus (which GPU
                 a rank uses; it imports net.hosts lazily, for the host's name)
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
  calls/         what a message means: outstanding calls, the caller, the outbox (every
                 message sent), the server and its actor slots, the multicast tree and the
                 calls gathering answers through this rank (gathering), supervision,
                 finalize, the main thread.
                 Stands on net/, spawn/ and wire/.
  front_door     what the layers above may ask of the parts, as methods of ``Runtime``
  process        ``Runtime``: the composition of the parts, one per process.  Each part
                 is given the collaborators it uses (the transport, the network, the
                 outbox, a bound method...), never the runtime.
  rank, template_server   the entry points of a rank and of the template

The front door.  The layers above import from this package only (``from ..runtime import
Runtime``), never a module under it; tests/system/test_layering.py checks it, lazy and
type-only imports included.  What they get is the names in ``__all__``, then the methods of
``Runtime`` (front_door.py), ``rt.io`` and ``rt.hooks``.  The names, by what they are for:

  the process    ``Runtime`` and the ``IOThread`` an agent builds one on, ``Completion``,
                 who is running (context: ``current_actor``, ``process_mesh``...), the
                 settings (``config``), the log's handler of last resort (``diagnostics``)
                 and folders and files of this user's alone (``private_files``)
  records, errors   what a failure or a death says, the runtime's exceptions, rank lists
                 as text, and whether a host has room (``NoRoom``, the ``*_shortfall``s)
  actor calls    what a call is made of: the envelope's ``Kind``/``Mode``/``Part``/
                 ``Status``, the payloads, pickling, and the marks the server looks for on
                 an actor's endpoints
  wire formats   what agents, jobs and the data plane speak, each exported as its module
                 (the module is the format: messages, encoding, constants): ``host_messages``,
                 ``agent_channel``, ``worker_wire``, ``worker_key``, ``segments``; and the
                 pieces an agent runs a host with (``TemplateClient``, ``LaunchConfig``,
                 ``LineReader`` for its ranks' lines,
                 ``loopback_for``, Curve keys) or a job holds one by (``AgentLink``)
  looking at processes   modules too: ``host_files`` (a mesh's history files, fetched
                 through its agents), ``hosts`` (which host this is), ``gpus`` (which GPU a
                 rank uses, and the collective backend a group can use), ``rejects`` (input
                 refused, counted), ``proc_stats``, ``stack_dump``, ``rank_logging``

A part's state is never a name here: what an upper layer needs of it is a method of
``Runtime``.  Importing this package imports nothing: each name loads its module when first
asked for (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers (isort's order); by purpose in _WHERE and _MODULES
    from . import config as config
    from . import diagnostics as diagnostics
    from . import gpus as gpus
    from . import private_files as private_files
    from .calls.actor_slots import CONCURRENT_MARK, ENDPOINT_MARK, STOP_METHOD, in_actor_event_loop
    from .completion import Completion
    from .context import MeshRef, actor_path, current_actor, new_actor_id, process_mesh
    from .errors import ActorError, MeshStopped, ProcessDied, SendFailed
    from .failure import DeathInfo, MeshFailure, RemoteFailure
    from .limits import raise_nofile_limit
    from .net import hosts as hosts
    from .net.io_thread import IOThread
    from .net.transport import loopback_for
    from .process import Runtime
    from .rank_sets import RankSpecError, counted, parse_ranks, rank_label
    from .spawn import agent_channel as agent_channel
    from .spawn import host_files as host_files
    from .spawn import host_messages as host_messages
    from .spawn import proc_stats as proc_stats
    from .spawn import rank_logging as rank_logging
    from .spawn import stack_dump as stack_dump
    from .spawn import worker_key as worker_key
    from .spawn import worker_wire as worker_wire
    from .spawn.agent_link import AgentLink
    from .spawn.capacity import (
        PID_MAX_LIMIT,
        NoRoom,
        Shortfall,
        controller_files_shortfall,
        host_shortfall,
        template_files_shortfall,
    )
    from .spawn.launch_config import LaunchConfig
    from .spawn.rank_output import LineReader
    from .spawn.template_client import TemplateClient
    from .wire import rejects as rejects
    from .wire import segments as segments
    from .wire.curve import CurveKeys, Gatekeeper
    from .wire.envelope import Kind, Mode, Part, Status
    from .wire.payloads import CallInfo, SpawnInfo
    from .wire.serialize import describe_unpicklable, dumps, dumps_plain
    from .wire.unpickling import loads

# name -> the module (under runtime/) that defines it
_WHERE = {
    # the process and its front door
    "Runtime": "process", "IOThread": "net.io_thread", "Completion": "completion",
    "MeshRef": "context", "actor_path": "context", "current_actor": "context", "new_actor_id": "context",
    "process_mesh": "context", "in_actor_event_loop": "calls.actor_slots", "raise_nofile_limit": "limits",
    # records and errors
    "ActorError": "errors", "ProcessDied": "errors", "SendFailed": "errors", "MeshStopped": "errors",
    "DeathInfo": "failure", "MeshFailure": "failure", "RemoteFailure": "failure",
    "RankSpecError": "rank_sets", "parse_ranks": "rank_sets", "rank_label": "rank_sets", "counted": "rank_sets",
    "NoRoom": "spawn.capacity", "Shortfall": "spawn.capacity", "PID_MAX_LIMIT": "spawn.capacity",
    "host_shortfall": "spawn.capacity", "controller_files_shortfall": "spawn.capacity",
    "template_files_shortfall": "spawn.capacity",
    # what an actor call is made of
    "ENDPOINT_MARK": "calls.actor_slots", "CONCURRENT_MARK": "calls.actor_slots", "STOP_METHOD": "calls.actor_slots",
    "Kind": "wire.envelope", "Mode": "wire.envelope", "Part": "wire.envelope", "Status": "wire.envelope",
    "CallInfo": "wire.payloads", "SpawnInfo": "wire.payloads",
    "dumps": "wire.serialize", "dumps_plain": "wire.serialize", "describe_unpicklable": "wire.serialize",
    "loads": "wire.unpickling",
    # the wire formats that agents, jobs and the data plane speak
    "AgentLink": "spawn.agent_link", "LaunchConfig": "spawn.launch_config", "LineReader": "spawn.rank_output",
    "TemplateClient": "spawn.template_client",
    "loopback_for": "net.transport", "CurveKeys": "wire.curve", "Gatekeeper": "wire.curve",
}

# name -> a module exported whole (the module is the concept: a format's messages, encoding and
# constants), under the name its callers use
_MODULES = {
    # the process's settings and its log's handler of last resort
    "config": "config", "diagnostics": "diagnostics",
    # folders and files of this user's alone, on a machine shared with others
    "private_files": "private_files",
    # the wire formats that agents, jobs and the data plane speak
    "agent_channel": "spawn.agent_channel", "host_messages": "spawn.host_messages",
    "worker_wire": "spawn.worker_wire", "worker_key": "spawn.worker_key", "segments": "wire.segments",
    # looking at processes and hosts
    "hosts": "net.hosts", "rejects": "wire.rejects", "gpus": "gpus",
    "proc_stats": "spawn.proc_stats", "stack_dump": "spawn.stack_dump", "rank_logging": "spawn.rank_logging",
    # a mesh's history files on its hosts, through their agents
    "host_files": "spawn.host_files",
}

# every name above; tests/system/test_layering.py reads it as the front door
__all__ = [
    "ActorError", "AgentLink", "CONCURRENT_MARK", "CallInfo", "Completion", "CurveKeys", "DeathInfo",
    "ENDPOINT_MARK", "Gatekeeper", "IOThread", "Kind", "LaunchConfig", "LineReader", "MeshFailure", "MeshRef",
    "MeshStopped", "Mode", "NoRoom", "PID_MAX_LIMIT", "Part", "ProcessDied", "RankSpecError", "RemoteFailure",
    "Runtime", "STOP_METHOD", "SendFailed", "Shortfall", "SpawnInfo", "Status", "TemplateClient", "actor_path",
    "agent_channel", "config", "controller_files_shortfall", "counted", "current_actor", "describe_unpicklable",
    "diagnostics", "dumps", "dumps_plain", "gpus", "host_files", "host_messages", "host_shortfall", "hosts",
    "in_actor_event_loop", "loads", "loopback_for", "new_actor_id", "parse_ranks", "private_files", "proc_stats",
    "process_mesh", "raise_nofile_limit", "rank_label", "rank_logging", "rejects", "segments", "stack_dump",
    "template_files_shortfall", "worker_key", "worker_wire",
]


def __getattr__(name: str):
    """Load a front-door name's module on first use (PEP 562)."""
    import importlib

    if name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
