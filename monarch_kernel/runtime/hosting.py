"""The runtime's second door, for what hosts ranks: the host agent and the worker (agent/), and
a job's end of their links (job/).  They import ``from ..runtime.hosting import X`` and nothing
else of runtime/; the layers that only use meshes never come in here.  It hands on the main
door's names these two use, and adds what only hosting needs: the template that forks ranks,
what each rank is told, whether a host has room, and the link to a host's agent with the
messages on it.  docs/how-it-works.md draws both doors; tests/system/test_layering.py checks them.

The names are written once, as the imports under ``TYPE_CHECKING`` (read as the main door's are,
see ``lazy_names``); importing this module imports nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_names

if TYPE_CHECKING:
    # isort: off
    from .lazy import lazy_names as lazy_names
    # the main door's names that agents and jobs use too
    from . import (
        CurveKeys as CurveKeys, Runtime as Runtime, config as config, counted as counted, diagnostics as diagnostics,
        host_shortfall as host_shortfall, hosts as hosts, PortTaken as PortTaken, private_files as private_files,
        proc_stats as proc_stats, rejects as rejects, process_mesh as process_mesh,
    )

    # forking ranks on a host: the template and its client, what each rank is told, how many
    # more the host's limits allow, the IO thread an agent's runtime runs on
    from .limits import raise_nofile_limit as raise_nofile_limit
    from .net.io_thread import IOThread as IOThread
    from .spawn.capacity import template_files_shortfall as template_files_shortfall
    from .spawn.launch_config import LaunchConfig as LaunchConfig
    from .spawn.template_client import TemplateClient as TemplateClient
    from .spawn.template_client import TemplateEvents as TemplateEvents
    # a warm standby: the heavy modules a live rank imported (restarted ranks fork from them)
    from .spawn.standby import warm_candidates as warm_candidates

    # a controller's link to the agent on each host: the link, its framing and messages (each
    # a module: the module is the format), the agent's address on its host, its Curve gate
    from .net.transport import loopback_for as loopback_for
    from .spawn import agent_channel as agent_channel
    from .spawn import host_messages as host_messages
    from .spawn.agent_link import AgentLink as AgentLink
    from .wire.curve import Gatekeeper as Gatekeeper

    # the run's history on each host: its ranks' lines as they are read, and its files fetched
    # through the hosts' agents
    from .spawn import host_files as host_files
    from .spawn.rank_output import SYNC_PATTERN as SYNC_PATTERN
    from .spawn.rank_output import LineReader as LineReader
    # isort: on

__getattr__, __dir__ = lazy_names(__name__, __file__)
