"""monarch-kernel: a single controller for meshes of Python processes.

Names follow ``monarch.actor``, so Monarch code ports by changing one import.  The layers
under it, and the process that runs each, are drawn in docs/how-it-works.md.  The tensor
names load torch on first use.  This module only re-exports, each name when first asked for;
importing it installs nothing.
"""

from typing import TYPE_CHECKING

from .runtime import lazy_names

# The actor API's names, each loaded on first use (``lazy_names`` reads these lines, as the
# runtime's doors do): a process that runs one of the package's modules (``python -m
# monarch_kernel.history.writer_process``, the command line, an agent) loads only what it uses.
if TYPE_CHECKING:
    # isort: off
    from .actor.accumulator import Accumulator as Accumulator
    from .actor.actor import Actor as Actor
    from .actor.actor import context as context
    from .actor.actor import current_actor_name as current_actor_name
    from .actor.actor import current_rank as current_rank
    from .actor.actor import current_size as current_size
    from .actor.actor_mesh import ActorMesh as ActorMesh
    from .actor.adverbs import Endpoint as Endpoint
    from .actor.controllers import get_or_spawn_controller as get_or_spawn_controller
    from .actor.endpoint import concurrent_endpoint as concurrent_endpoint
    from .actor.endpoint import endpoint as endpoint
    from .actor.errors import ActorError as ActorError
    from .actor.errors import HangError as HangError
    from .actor.errors import MeshFailure as MeshFailure
    from .actor.errors import MeshStopped as MeshStopped
    from .actor.errors import ProcessDied as ProcessDied
    from .actor.fault_hook import unhandled_fault_hook as unhandled_fault_hook
    from .actor.future import Future as Future
    from .actor.host_mesh import HostMesh as HostMesh
    from .actor.host_mesh import this_host as this_host
    from .actor.host_mesh import this_proc as this_proc
    from .actor.port import Channel as Channel
    from .actor.port import Port as Port
    from .actor.port import PortReceiver as PortReceiver
    from .actor.proc_mesh import ProcMesh as ProcMesh
    from .actor.restart_event import RestartEvent as RestartEvent
    from .actor.restart_event import RestartPolicy as RestartPolicy
    from .actor.send import send as send
    from .actor.shape import Extent as Extent
    from .actor.shape import Point as Point
    from .actor.shape import Shape as Shape
    from .actor.shutdown import shutdown_context as shutdown_context
    from .actor.value_mesh import ValueMesh as ValueMesh
    # isort: on

__all__ = [
    "Accumulator", "Actor", "ActorError", "ActorMesh", "Channel", "Endpoint", "Extent", "Future", "HostMesh",
    "HangError", "MeshFailure", "MeshStopped", "Point", "Port", "PortReceiver", "ProcMesh", "ProcessDied",
    "RDMABuffer", "RestartEvent", "RestartPolicy", "Shape", "ValueMesh",
    "concurrent_endpoint", "context", "current_actor_name", "current_rank", "current_size", "endpoint",
    "get_or_spawn_controller",
    "shutdown_context", "this_host", "this_proc", "unhandled_fault_hook",
    # the run's history, on disk, asked in SQL (history/)
    "history", "history_root", "metric",
    # workers that any scheduler starts, and the notebook that attaches to them
    "attach_to_workers", "run_worker_loop_forever",
    # distributed tensors (Monarch's top-level ``monarch`` names)
    "RemoteException", "Stream", "Tensor", "call_on_shard_and_fetch", "fetch_shard", "get_active_mesh",
    "get_active_stream", "grad_function", "grad_generator", "inspect", "no_mesh", "reduce", "reduce_", "remote",
    "send", "show", "slice_mesh", "to_mesh",
]

# Distributed tensors load on first use (they import torch): name -> module under tensors/.
_TENSOR_NAMES = {
    "RemoteException": "errors", "Tensor": "controller.tensor",
    "call_on_shard_and_fetch": "controller.fetch", "fetch_shard": "controller.fetch",
    "inspect": "controller.fetch", "show": "controller.fetch",
    "get_active_mesh": "controller.meshes", "no_mesh": "controller.meshes", "slice_mesh": "controller.meshes",
    "reduce": "controller.collective_calls", "reduce_": "controller.collective_calls",
    "to_mesh": "controller.collective_calls", "remote": "controller.remote",
    "Stream": "controller.streams", "get_active_stream": "controller.streams", "grad_generator": "controller.streams",
    "grad_function": "controller.streams",
}


def __getattr__(name: str):
    # The data plane loads on first use: most ranks never touch it.
    if name == "RDMABuffer":
        from .data import RDMABuffer

        return RDMABuffer
    # Jobs and workers too: only a controller with hosts, and a worker's host, use them.
    if name == "attach_to_workers":
        from .job.attach import attach_to_workers

        return attach_to_workers
    if name == "run_worker_loop_forever":
        from .agent.worker import run_worker_loop_forever

        return run_worker_loop_forever
    # The history: the package itself (callable: ``history(name)``), and two of its names.
    if name in ("history", "history_root", "metric"):
        import importlib

        module = importlib.import_module(".history", __name__)
        return module if name == "history" else getattr(module, name)
    if name in _TENSOR_NAMES:
        import importlib

        value = getattr(importlib.import_module(f".tensors.{_TENSOR_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    return _actor_names(name)  # the actor API (its AttributeError names the package)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_actor_names, _ = lazy_names(__name__, __file__)


def load_ipython_extension(ip) -> None:
    """``%load_ext monarch_kernel``: the ``%mesh`` magics in any IPython."""
    from .kernel import load_magics

    load_magics(ip)


def unload_ipython_extension(ip) -> None:
    """``%unload_ext monarch_kernel``: the magics' runtime hooks come out again."""
    from .kernel import unload_magics

    unload_magics(ip)
