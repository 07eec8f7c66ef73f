"""The actor layer's side of distributed tensors: ``TensorEngine``, an actor on every rank
of a proc mesh that runs the ranks' executor, and ``EngineBackend``, the tensors layer's
``Backend`` over it.  Batches go one-way to every rank (``tell``: no answers); values come
back through ``call_one`` / ``call``, with the batch not sent yet riding in the same message
(``run_and_request``), and with an explicit response port when a request overtook an
earlier batch, so that it waits on the rank, not on the controller.

Spawned lazily, once per proc mesh, by the first ``procs.activate()``.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from .actor import Actor, current_rank
from .actor_mesh import ActorMesh
from .endpoint import endpoint
from .rendezvous import serve_rendezvous
from .shape import Point, Shape
from .value_mesh import ValueMesh

# What a request answers when it overtook the batch it must follow (batches go down the tree,
# requests straight to a rank): the controller asks again, and then the rank waits for it.
NOT_YET = "__monarch_kernel_tensor_not_yet__"


class TensorEngine(Actor):
    """Holds this rank's executor (the shards of every live distributed tensor)."""

    def __init__(self, key: str, store=None):
        from ..tensors.rank.executor import Executor

        rank = current_rank().rank
        self.executor = Executor(rank, key, seed=rank, store=store)

    @endpoint
    def run(self, seq: int, payload: bytes, made: list) -> None:
        self.executor.run_batch(seq, payload, made)

    @endpoint
    def request(self, seq: int, fn, args, kwargs):
        return self.executor.answer(seq, fn, args, kwargs, NOT_YET)

    @endpoint
    def run_and_request(self, seq: int, payload: bytes, made: list, fn, args, kwargs):
        """``run`` then ``request``, in one message: a fetch right after its ops."""
        self.executor.run_batch(seq, payload, made)
        return self.executor.answer(seq, fn, args, kwargs, NOT_YET)

    @endpoint(explicit_response_port=True)
    def request_later(self, port, seq: int, fn, args, kwargs) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint
    def send_to(self, seq: int, fn, args, kwargs, port) -> None:
        self.executor.request(seq, fn, args, kwargs, port.send)

    @endpoint
    def stats(self, seq: int):
        return self.executor.answer(seq, self.executor.stats, (), {}, NOT_YET)

    def __cleanup__(self, exc) -> None:
        self.executor.close()


class EngineBackend:
    """A ``tensors.controller.client.Backend`` over the tensor engines of one proc mesh."""

    def __init__(self, procs):
        from .proc_mesh import ProcMesh

        root = ProcMesh(procs.ref, Shape.full(procs.ref.dims), procs._owned)
        self.name = procs.name
        self.mesh_id = procs.ref.id
        self.key = f"{procs.ref.id}/{secrets.token_hex(4)}"
        self.world = len(root.shape)
        # The rendezvous of the ranks' process groups for reductions and to_mesh, kept here.
        self.rendezvous_server, self.rendezvous = serve_rendezvous(procs.ref.hosts)
        try:
            self.engines: ActorMesh = root.spawn("tensor_engine", TensorEngine, self.key, self.rendezvous)
        except BaseException:
            self.rendezvous_server.close()
            raise
        self._one: dict[int, ActorMesh] = {}

    def close(self) -> None:
        """The proc mesh stopped: the rendezvous's keys go with it."""
        self.rendezvous_server.close()

    def _at(self, rank: int) -> ActorMesh:
        m = self._one.get(rank)
        if m is None:
            point = Point.from_rank(rank, self.engines.extent)
            m = self._one[rank] = self.engines.slice(**point)
        return m

    def _over(self, shape) -> ActorMesh:
        e = self.engines
        return ActorMesh(e.proc_ref, e.actor_id, e.name, "TensorEngine", e._endpoints, shape)

    def send(self, seq: int, payload: bytes, made: list) -> None:
        self.engines.run.tell(seq, payload, made)  # the executor never raises: no answer to wait for

    def request(self, rank: int, seq: int, fn, args, kwargs, transform, batch=None):
        def settle(v):
            if isinstance(v, str) and v == NOT_YET:
                v = self._at(rank).request_later.call_one(seq, fn, args, kwargs).get()
            return transform(v)

        if batch is None:
            return self._at(rank).request.call_one(seq, fn, args, kwargs).map(settle)
        answer = self._at(rank).run_and_request.call_one(seq, *batch, fn, args, kwargs)  # the rank asked, first
        self._tell_others({rank}, seq, batch)
        return answer.map(settle)

    def request_all(self, shape, seq: int, fn, args, kwargs, transform, batch=None):
        ranks = list(shape.ranks)

        def each(vm: ValueMesh) -> ValueMesh:
            values = list(vm.values())
            for i, v in enumerate(values):
                if isinstance(v, str) and v == NOT_YET:
                    values[i] = self._at(ranks[i]).request_later.call_one(seq, fn, args, kwargs).get()
            return ValueMesh(vm.shape, [transform(v) for v in values])

        if batch is None:
            return self._over(shape).request.call(seq, fn, args, kwargs).map(each)
        answers = self._over(shape).run_and_request.call(seq, *batch, fn, args, kwargs)
        self._tell_others(set(ranks), seq, batch)
        return answers.map(each)

    def _tell_others(self, asked: set, seq: int, batch) -> None:
        """Batch ``seq``, which went to the ``asked`` ranks with their request, to the rest."""
        others = [r for r in self.engines.shape.ranks if r not in asked]
        if others:
            self.engines.run.tell_to(others, seq, *batch)

    def send_to_port(self, shape, seq: int, fn, args, kwargs, port) -> None:
        self._over(shape).send_to.broadcast(seq, fn, args, kwargs, port)

    def stats(self, seq: int):
        """A Future of a ValueMesh of each rank's executor stats (refs, bytes, ops, busy_s)."""
        return self.request_all(self.engines.shape, seq, _stats, (), {}, lambda v: v)


_CLIENTS: dict[str, Any] = {}  # proc mesh id -> its MeshClient
_LOCK = threading.Lock()


def tensor_client(procs):
    """The proc mesh's tensor client, its engines spawned on first use."""
    from ..tensors.controller.client import MeshClient

    with _LOCK:
        client = _CLIENTS.get(procs.ref.id)
        if client is None or procs.stopped:
            if client is not None:
                _close(client)
            client = _CLIENTS[procs.ref.id] = MeshClient(EngineBackend(procs))
    return client


def forget(mesh_id: str) -> None:
    """The proc mesh stopped: its client stops sending (and its flush thread ends)."""
    with _LOCK:
        client = _CLIENTS.pop(mesh_id, None)
    if client is not None:
        _close(client)


def _close(client) -> None:
    client.close()
    backend = client.backend
    if isinstance(backend, EngineBackend):
        backend.close()


def live_tensors() -> dict[str, list[dict]]:
    """``{mesh name: [{shape, dtype, device, bytes}, ...]}``: the live distributed tensors
    (``%mesh tensors``; bytes are each rank's)."""
    out: dict[str, list[dict]] = {}
    for client in list(_CLIENTS.values()):
        rows = client.listing()
        if rows:
            out[client.name] = rows
    return out


def live_handles() -> dict[str, list]:
    """``{mesh name: [handle, ...]}``: the live distributed tensors themselves, for a caller
    that tells them apart (``%mesh tensors`` names each by the notebook variable holding it);
    ``describe(handle)`` gives a row of ``live_tensors``."""
    out: dict[str, list] = {}
    for client in list(_CLIENTS.values()):
        handles = client.live()
        if handles:
            out[client.name] = handles
    return out


def describe(handle) -> dict:
    """``{shape, dtype, device, bytes}`` of one distributed tensor (bytes: each rank's)."""
    from ..tensors.controller.client import describe as describe_handle

    return describe_handle(handle)


def tensor_totals(mesh_id: str) -> tuple[int, int]:
    """``(count, bytes per rank)`` of the live distributed tensors of proc mesh ``mesh_id``
    (the Mesh panel); ``(0, 0)`` before its first ``activate()``."""
    client = _CLIENTS.get(mesh_id)
    if client is None:
        return 0, 0
    rows = client.listing()
    return len(rows), sum(r["bytes"] for r in rows)


def tensor_mesh(procs):
    """The ``TensorMesh`` of ``procs`` (a whole proc mesh or a slice of one): the same one
    each time for the same ranks, so handles compare their meshes by identity."""
    from ..tensors.controller.meshes import TensorMesh

    client = tensor_client(procs)
    key = (id(client), procs.shape.ranks, procs.shape.extent)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.client is not client:
        mesh = _MESHES[key] = TensorMesh(client, procs.shape, procs)
    return mesh


_MESHES: dict[tuple, object] = {}  # (client, ranks, extent) -> its TensorMesh


def _stats():
    from ..tensors.rank.values import current_stats

    return current_stats()


def rref(mesh: ActorMesh, method: str, args, kwargs):
    """``endpoint.rref(...)``: the endpoint runs on every rank of ``mesh``; its result stays
    there as distributed tensors, whose shapes ``propagate`` gives now."""
    from ..tensors.controller.meshes import active
    from ..tensors.controller.remote import promise
    from .endpoint import RREF_METHOD, Endpoint

    propagate = (mesh._propagators or {}).get(method)
    if propagate is None:
        raise ValueError(f"{mesh._class_name}.{method}.rref(...) needs its result's shape: declare it with "
                         f"@endpoint(propagate=lambda *args: ...) (a function of the arguments' fake tensors)")
    pm = mesh._proc_mesh
    tm = active()
    if tm is None or tm.client.backend.mesh_id != mesh.proc_ref.id:
        if pm is None:
            raise ValueError("rref needs the actors' proc mesh active: `with procs.activate():`")
        tm = tensor_mesh(pm.slice(**{}) if not len(mesh.shape.extent) else pm)
    result, out = promise(tm, propagate, args, kwargs)
    Endpoint(mesh, RREF_METHOD).broadcast(tm.client.backend.key, method, out, args, kwargs)
    return result


def keep_result(actor, key: str, method: str, out, args, kwargs) -> None:
    """On a rank (``Actor.__monarch_rref__``): run ``method`` and bind its result to ``out``
    in the tensor engine's executor."""
    import asyncio
    import inspect

    from ..tensors.rank.executor import executor_for

    ex = executor_for(key, timeout=60.0)
    if ex is None:
        raise RuntimeError("rref: this process has no tensor engine for the mesh (activate the actors' procs)")
    fn = getattr(type(actor), method)
    fn = getattr(fn, "__wrapped__", fn)
    try:
        value = fn(actor, *args, **kwargs)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
    except Exception as e:  # noqa: BLE001  (the error poisons the results; whoever reads them hears of it)
        ex.fulfill(out, error=e, what=f"{type(actor).__qualname__}.{method}")
        return
    ex.fulfill(out, value)
