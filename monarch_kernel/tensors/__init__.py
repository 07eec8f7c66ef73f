"""Distributed tensors: torch code recorded on the controller inside ``procs.activate()``
and run by an executor on every rank.  ``controller/`` records and fetches; ``rank/``
executes and reduces (``collectives.py``); ``messages.py`` is what travels between them,
``errors.py`` what either raises to a user.
Above ``actor/``: the tensor engine is an actor on every rank (``rank/engine.py``),
driven by the controller's ``EngineBackend``; the actor layer reaches this package only
through ``actor/tensor_shim.py``, whose slot importing it fills (``shim.py``).  Importing it
imports only those two small modules (torch loads once a tensor exists)."""

from ..actor import tensor_shim as _tensor_shim
from .shim import ActorSide as _ActorSide

_tensor_shim.install(_ActorSide())
