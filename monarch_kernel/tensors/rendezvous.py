"""Where the ranks of one activation meet to make their process groups: ``Rendezvous``, the
small reference every tensor engine is given, and ``Keeper``, what it leads to.  The keys
live in the controller (``controller/keys.py``) and travel as the runtime's own signed
messages, so no listener is opened for them and nothing outside the job can read or write
them; the key prefix only keeps groups and activations apart, it is no secret.  Imports no
torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# What a keeper answers to (``KeyTable``'s operations, by name).
OPERATIONS = ("set", "multi_set", "add", "compare_set", "append", "delete_key", "num_keys", "check", "wait")


class Keeper(Protocol):
    """The way from a rank to the keys of its activation."""

    def ask(self, op: str, args: tuple, timeout: float | None) -> Any:
        """Run ``op`` (one of ``OPERATIONS``, with ``KeyTable``'s arguments; ``wait``'s are
        ``(keys, values)``) on the keys and return its answer; raise ``TimeoutError`` if a
        ``wait`` is not over within ``timeout`` seconds (None: no limit)."""


@dataclass(frozen=True)
class Rendezvous:
    """One activation's rendezvous, as the ranks see it: where its keys are kept, the prefix
    its groups' keys start with, and whether every rank runs on one host (then gloo binds
    the loopback).  Two compare equal when their prefix does (a fresh one per activation)."""

    prefix: str
    local: bool
    keeper: Any = field(compare=False)  # a Keeper (the actor layer's, picklable)

    def __repr__(self) -> str:
        return f"Rendezvous({self.prefix!r}, local={self.local})"
