"""The rendezvous of an activation's process groups, kept by the process that activates the
mesh: ``RendezvousKeeper``, an actor hosted in that process itself (``this_proc()``) that
holds the keys (``KeyTable``), and ``KeeperClient``, the ranks' way to it.  Its operations
are the mesh's own signed calls, so it opens no port and only the job's processes reach it.
Stopping the keeper (when the proc mesh stops) drops every key.

Example::

    keeper, rendezvous = serve_rendezvous(procs.ref.hosts)   # then, on each rank:
    Collectives(dims, ranks, me, rendezvous)
"""

from __future__ import annotations

import secrets
import socket
from typing import Any

from ..runtime.failure import ActorError
from ..tensors.controller.keys import KeyTable
from ..tensors.rendezvous import OPERATIONS, Rendezvous
from .actor import Actor
from .actor_mesh import ActorMesh
from .endpoint import endpoint
from .host_mesh import this_proc

# A wait's answer may come this much after its own timeout (the call's trip, a busy keeper)
# before the rank gives up on hearing it.
ANSWER_GRACE_S = 30.0


class RendezvousKeeper(Actor):
    """The keys of one activation.  Every endpoint is a coroutine on the actor's loop, and a
    wait is a task there of its own, so a rank waiting for a key holds no one else up."""

    def __init__(self) -> None:
        self.table = KeyTable()

    @endpoint
    async def set(self, key: str, value: bytes) -> None:
        self.table.set(key, value)

    @endpoint
    async def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self.table.multi_set(keys, values)

    @endpoint
    async def add(self, key: str, amount: int) -> int:
        return self.table.add(key, amount)

    @endpoint
    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.table.compare_set(key, expected, desired)

    @endpoint
    async def append(self, key: str, value: bytes) -> None:
        self.table.append(key, value)

    @endpoint
    async def delete_key(self, key: str) -> bool:
        return self.table.delete_key(key)

    @endpoint
    async def num_keys(self) -> int:
        return self.table.num_keys()

    @endpoint
    async def check(self, keys: list[str]) -> bool:
        return self.table.check(keys)

    @endpoint
    async def waiting(self) -> dict[str, int]:
        """``{key: waits}``: the keys ranks wait for now."""
        return self.table.waiting()

    @endpoint(concurrent=True)
    async def wait(self, keys: list[str], timeout: float | None, values: bool = False):
        return await self.table.wait(keys, timeout, values)

    def __cleanup__(self, exc) -> None:
        self.table.clear()


class KeeperClient:
    """A ``Keeper`` (tensors/rendezvous.py) over the keeper's actor mesh; picklable, so
    it travels to the ranks inside their ``Rendezvous``."""

    def __init__(self, mesh: ActorMesh):
        self.mesh = mesh

    def ask(self, op: str, args: tuple, timeout: float | None) -> Any:
        if op not in OPERATIONS:
            raise ValueError(f"the rendezvous has no operation {op!r}; it has {', '.join(OPERATIONS)}")
        answer = getattr(self.mesh, op).call_one(*args)
        try:
            return answer.get(timeout=None if timeout is None else timeout + ANSWER_GRACE_S)
        except ActorError as e:
            if isinstance(e.__cause__, TimeoutError):
                raise TimeoutError(str(e.__cause__)) from None
            raise


def serve_rendezvous(hosts) -> tuple[ActorMesh, Rendezvous]:
    """A keeper in this process, and the ``Rendezvous`` that leads the ranks on ``hosts``
    (a proc mesh's host names) to it, with a fresh key prefix."""
    keeper: ActorMesh = this_proc().spawn("tensor_rendezvous", RendezvousKeeper)
    return keeper, Rendezvous(secrets.token_hex(8), _one_host(hosts), KeeperClient(keeper))


def _one_host(hosts) -> bool:
    """Whether every rank runs on one host (then the ranks' gloo binds the loopback)."""
    here = {socket.gethostname(), "localhost", "127.0.0.1", "", None}
    return len(set(hosts)) <= 1 or all(h in here for h in hosts)
