"""``send``, as Monarch has it twice: ``monarch.actor.send(endpoint, ...)`` fires an
endpoint at every rank or one chosen rank, and ``monarch.send(remote_fn, ...)`` runs a
remote function on the active tensor mesh.  One name serves both, as one import of
``monarch_kernel`` stands for both of Monarch's; only the second loads the tensor engine."""

from __future__ import annotations

from typing import Any

from . import tensor_shim
from .adverbs import Endpoint


def send(endpoint, args: tuple = (), kwargs: dict[str, Any] | None = None, port=None,
         selection: str = "all") -> None:
    """Fire and forget: ``endpoint`` runs on the ranks ``selection`` names (``"all"``, or
    ``"choose"``: the least loaded one); with ``port`` their values are sent there.

    Example::

        send(generators.update_weights, (weights,), {}, selection="choose")
    """
    kwargs = kwargs or {}
    if isinstance(endpoint, Endpoint):
        endpoint._send_selected(tuple(args), kwargs, port, selection)
        return
    tensor_shim.tensors().send(endpoint, args, kwargs, port, selection)
