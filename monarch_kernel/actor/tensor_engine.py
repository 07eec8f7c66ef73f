"""The actor layer's side of distributed tensors: ``TensorEngine``, an actor on every rank
of a proc mesh that runs the ranks' executor, and ``EngineBackend``, the tensors layer's
``Backend`` over it.  Batches go one-way down the multicast tree (``broadcast``); values come
back through ``call_one`` / ``call`` with an explicit response port, so a request that
overtook an earlier batch waits on the rank, not on the controller.

Spawned lazily, once per proc mesh, by the first ``procs.activate()``.
"""

from __future__ import annotations

import secrets
import threading

from .actor import Actor, current_rank
from .actor_mesh import ActorMesh
from .endpoint import endpoint
from .shape import Point, Shape
from .value_mesh import ValueMesh


class TensorEngine(Actor):
    """Holds this rank's executor (the shards of every live distributed tensor)."""

    def __init__(self, key: str):
        from ..tensors.rank.executor import Executor

        rank = current_rank().rank
        self.executor = Executor(rank, key, seed=rank)

    @endpoint
    def run(self, seq: int, payload: bytes, made: list) -> None:
        self.executor.run_batch(seq, payload, made)

    @endpoint(explicit_response_port=True)
    def request(self, port, seq: int, fn, args, kwargs) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint
    def send_to(self, seq: int, fn, args, kwargs, port) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint(explicit_response_port=True)
    def stats(self, port, seq: int) -> None:
        self.executor.request(seq, self.executor.stats, (), {}, port.send)

    def __cleanup__(self, exc) -> None:
        self.executor.close()


class EngineBackend:
    """A ``tensors.controller.client.Backend`` over the tensor engines of one proc mesh."""

    def __init__(self, procs):
        from .proc_mesh import ProcMesh

        root = ProcMesh(procs.ref, Shape.full(procs.ref.dims), procs._owned)
        self.name = procs.name
        self.key = f"{procs.ref.id}/{secrets.token_hex(4)}"
        self.world = len(root.shape)
        self.engines: ActorMesh = root.spawn("tensor_engine", TensorEngine, self.key)
        self._one: dict[int, ActorMesh] = {}

    def _at(self, rank: int) -> ActorMesh:
        m = self._one.get(rank)
        if m is None:
            point = Point.from_rank(rank, self.engines.extent)
            m = self._one[rank] = self.engines.slice(**point)
        return m

    def _over(self, shape) -> ActorMesh:
        e = self.engines
        return ActorMesh(e.proc_ref, e.actor_id, e.name, "TensorEngine", ("request", "run", "send_to", "stats"),
                         shape)

    def send(self, seq: int, payload: bytes, made: list) -> None:
        self.engines.run.broadcast(seq, payload, made)

    def request(self, rank: int, seq: int, fn, args, kwargs, transform):
        return self._at(rank).request.call_one(seq, fn, args, kwargs).map(transform)

    def request_all(self, shape, seq: int, fn, args, kwargs, transform):
        def each(vm: ValueMesh) -> ValueMesh:
            return ValueMesh(vm.shape, [transform(v) for v in vm.values()])

        return self._over(shape).request.call(seq, fn, args, kwargs).map(each)

    def send_to_port(self, shape, seq: int, fn, args, kwargs, port) -> None:
        self._over(shape).send_to.broadcast(seq, fn, args, kwargs, port)

    def stats(self, seq: int):
        return self.engines.stats.call(seq)


_CLIENTS: dict[str, object] = {}  # proc mesh id -> its MeshClient
_LOCK = threading.Lock()


def tensor_client(procs):
    """The proc mesh's tensor client, its engines spawned on first use."""
    from ..tensors.controller.client import MeshClient

    with _LOCK:
        client = _CLIENTS.get(procs.ref.id)
        if client is None or procs.stopped:
            if client is not None:
                client.close()
            client = _CLIENTS[procs.ref.id] = MeshClient(EngineBackend(procs))
    return client


def tensor_mesh(procs):
    """The ``TensorMesh`` of ``procs`` (a whole proc mesh or a slice of one)."""
    from ..tensors.controller.meshes import TensorMesh

    return TensorMesh(tensor_client(procs), procs.shape, procs)
