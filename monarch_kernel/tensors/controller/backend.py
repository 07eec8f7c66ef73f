"""``EngineBackend``: a ``MeshClient``'s ``Backend`` over the tensor engines of one proc
mesh (``rank/engine.py``), through the actor layer.  Batches go one-way to every rank
(``tell``: no answers); values come back through ``call_one`` / ``call``, with the batch
not sent yet riding in the same message (``run_and_request``), and with an explicit
response port when a request overtook an earlier batch, so that it waits on the rank, not
on the controller.
"""

from __future__ import annotations

import secrets

from ...actor.actor_mesh import ActorMesh, endpoint_names
from ...actor.proc_mesh import whole_mesh
from ...actor.shape import Point
from ...actor.value_mesh import ValueMesh
from ..rank.engine import NOT_YET, TensorEngine, engine_stats
from ..rendezvous_actor import serve_rendezvous

_ENDPOINTS = endpoint_names(TensorEngine)


class EngineBackend:
    """A ``tensors.controller.client.Backend`` over the tensor engines of one proc mesh."""

    def __init__(self, procs):
        root = whole_mesh(procs)
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
        return ActorMesh(e.proc_ref, e.actor_id, e.name, "TensorEngine", _ENDPOINTS, shape)

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
        return self.request_all(self.engines.shape, seq, engine_stats, (), {}, lambda v: v)
