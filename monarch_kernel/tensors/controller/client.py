"""``MeshClient``: the controller's side of one proc mesh's tensor engine.  It hands out
refs, keeps the batch being recorded, and sends it to every rank through its ``Backend``
(with a fetch, which carries it to the rank it asks; at ``tensor_batch`` ops; or
``tensor_flush`` seconds after its first op); it never waits for the ranks itself.

Handles that die add their refs to a delete list (from any thread, lock-free: a finalizer
may run inside the recording code), which goes out with the next batch.
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import pickle
import threading
import time
import weakref
from typing import Any, Protocol

from ...runtime import config
from ..messages import DELETE, GRAD_MODE, RANKS, STREAM
from .meshes import state


class Backend(Protocol):
    """How a client reaches its ranks; ``EngineBackend`` (``backend.py``) implements it
    over a tensor engine actor on every rank.  ``key`` names the executors; ``mesh_id``: the proc mesh's id;
    ``world``: its ranks; ``name``: its name, for messages."""

    key: str
    mesh_id: str
    world: int
    name: str

    def send(self, seq: int, payload: bytes, made: list[int]) -> None:
        """Batch ``seq`` to every rank, one-way, in the order of ``seq``."""

    def request(self, rank: int, seq: int, fn, args, kwargs, transform, batch=None) -> Any:
        """A Future of ``transform(fn(*args, **kwargs))`` computed on ``rank`` after batch
        ``seq`` (``fn`` None: ``args[0]``).  ``batch``: batch ``seq`` itself as
        ``(payload, made)``, not sent yet: it goes to ``rank`` with the request, and to the
        other ranks as ``send`` would."""

    def request_all(self, shape, seq: int, fn, args, kwargs, transform, batch=None) -> Any:
        """The same on every rank of ``shape``: a Future of a ValueMesh."""

    def send_to_port(self, shape, seq: int, fn, args, kwargs, port) -> None:
        """Every rank of ``shape`` sends its ``fn(...)`` to ``port``."""


# The proc mesh whose actors the arguments being pickled go to (set by the actor layer,
# through ``actor/tensor_shim.py``'s ``pinned_for``).
destination: contextvars.ContextVar[str | None] = contextvars.ContextVar("destination", default=None)
# The handles pickled into that call's arguments, which the actor layer keeps alive until the
# call is answered (a rank looks their shards up when it unpickles them).
pinned: contextvars.ContextVar[list | None] = contextvars.ContextVar("pinned", default=None)


class _Handle(weakref.ref):
    __slots__ = ("ref", "client")
    ref: int
    client: MeshClient


def _died(h: _Handle) -> None:
    client = h.client
    client.dead.append(h.ref)
    client.handles.pop(h.ref, None)


class MeshClient:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.world = backend.world
        self.name = backend.name
        self.handles: dict[int, _Handle] = {}  # ref -> the live handle
        self.dead: collections.deque = collections.deque()  # refs whose handles died
        self.later: collections.deque = collections.deque()  # messages from finalizers, for the next batch
        self._refs = itertools.count(1)
        self._lock = threading.Lock()
        self._batch: list = []
        self._made: list[int] = []
        self.seq = 0  # the last batch sent
        self._grad = True  # the grad mode the ranks are in after what was recorded
        self._ranks: frozenset | None = None  # the ranks the recorded ops run on
        self._stream: Any = None  # the stream they run on (None: the main one)
        self._limit = config.get("tensor_batch")
        self._delay = config.get("tensor_flush")
        self._wake = threading.Event()
        self._deletes_due: float | None = None  # when deletes a fetch left behind go on their own
        self._flusher: threading.Thread | None = None
        self.closed = False

    # ------------------------------------------------------------ recording

    def new_ref(self) -> int:
        return next(self._refs)

    def adopt(self, t) -> None:
        """Track a new handle: when it dies, its ref is deleted on the ranks."""
        h = _Handle(t, _died)
        h.ref, h.client = t._ref, self
        self.handles[t._ref] = h

    def record(self, msg: tuple, made: list[int], ranks, grad: bool) -> None:
        """Append one message for ``ranks`` (None: all), recorded in grad mode ``grad``, on
        the active stream."""
        stream = state.stream
        with self._lock:
            batch = self._batch
            if not batch and self._flusher is not None:
                self._wake.set()
            if stream is not self._stream:
                batch.append((STREAM, None if stream is None else stream.key))
                self._stream = stream
            if ranks is not self._ranks and ranks != self._ranks:
                batch.append((RANKS, ranks))
                self._ranks = ranks
            if grad is not self._grad:
                batch.append((GRAD_MODE, grad))
                self._grad = grad
            batch.append(msg)
            if made:
                self._made.extend(made)
            full = len(batch) >= self._limit
        if full:
            self.flush()
        elif self._flusher is None:
            self._start_flusher()

    def flush(self, deletes: bool = True) -> int:
        """Send what was recorded (and the deletes); returns the last batch's seq.  The
        batch is encoded and sent outside the lock (recording goes on meanwhile); batches
        may so leave out of order, and the ranks put them back in order.  ``deletes=False``
        (a fetch): deletes alone are no reason to send, since a fetch needs only the ops
        before it, and a batch of them would wake every rank in its way; they go with the
        next batch, or after ten times ``tensor_flush`` seconds."""
        seq, batch = self._take(deletes)
        if batch is not None:
            self.backend.send(seq, *batch)
        return seq

    def _take(self, deletes: bool) -> tuple[int, tuple[bytes, list[int]] | None]:
        """The recorded batch taken for sending, as ``(seq, (payload, made))``, or
        ``(the last seq, None)`` when there is nothing to send (see ``flush``)."""
        dead, later = self.dead, self.later
        with self._lock:
            batch, made = self._batch, self._made
            while later:
                batch.append(later.popleft())
            if not batch and not deletes:
                if dead and self._deletes_due is None:
                    self._deletes_due = time.monotonic() + 10 * self._delay
                    self._send_later()
                return self.seq, None
            self._deletes_due = None
            if dead:
                refs = []
                try:
                    while True:
                        refs.append(dead.popleft())
                except IndexError:
                    pass
                batch.append((DELETE, refs))
            if not batch:
                return self.seq, None
            self._batch, self._made = [], []
            self.seq += 1
            seq = self.seq
        return seq, (_encode(batch), made)

    def _send_later(self) -> None:
        """(Holding the lock.) Have the flusher send what waits within ``tensor_flush`` s."""
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_later, name="monarch-kernel-tensor-flush",
                                             daemon=True)
            self._flusher.start()
        self._wake.set()

    def _start_flusher(self) -> None:
        with self._lock:
            self._send_later()

    def _flush_later(self) -> None:
        """Sends a batch that has waited ``tensor_flush`` seconds: ops recorded in a long
        ``activate()`` block (or a loop without fetches) start on the ranks meanwhile."""
        wake = self._wake
        while not self.closed:
            wake.wait()
            wake.clear()
            if self.closed:
                return
            time.sleep(self._delay)
            try:
                if not self._batch and self.dead:
                    # Deletes alone (a fetch took the batch this wake was for): they wait as
                    # a fetch leaves them, ten times tensor_flush, for a batch to carry them.
                    with self._lock:
                        if self._deletes_due is None:
                            self._deletes_due = time.monotonic() + 10 * self._delay
                        due = self._deletes_due
                    if wake.wait(max(0.0, due - time.monotonic())):
                        continue  # ops were recorded meanwhile: their batch carries the deletes
                if self._batch or self.dead:
                    self.flush()
            except Exception:  # noqa: BLE001  (the mesh stopped: the next fetch says so)
                return

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    # ------------------------------------------------------------ values

    def request(self, rank: int, fn, args, kwargs, transform):
        """What was recorded goes with the request, in one message to ``rank`` (sent first)
        and a batch to every other rank: a fetch right after an op costs the rank it asks
        one message, not two."""
        seq, batch = self._take(deletes=False)
        return self.backend.request(rank, seq, fn, encode_value(args), encode_value(kwargs), transform, batch)

    def request_all(self, shape, fn, args, kwargs, transform):
        seq, batch = self._take(deletes=False)
        return self.backend.request_all(shape, seq, fn, encode_value(args), encode_value(kwargs), transform, batch)

    def send_to_port(self, shape, fn, args, kwargs, port) -> None:
        seq = self.flush(deletes=False)
        self.backend.send_to_port(shape, seq, fn, encode_value(args), encode_value(kwargs), port)

    def pickled_handle(self, t):
        """``__reduce_ex__`` of a handle passed to an actor: after what was recorded is sent,
        the rank looks its shard up in its executor."""
        from ..rank.executor import local_shard

        dest = destination.get()
        if dest is not None and dest != self.backend.mesh_id:
            raise ValueError(f"a distributed tensor of mesh '{self.name}' passed to actors on other procs; an actor "
                             "gets a rank's shard only on the procs the tensor lives on (move it with to_mesh, or "
                             "send inspect(t))")
        seq = self.flush(deletes=False)
        pins = pinned.get()
        if pins is not None:
            pins.append(t)
        return (local_shard, (self.backend.key, t._ref, seq))

    def live(self) -> list:
        """The live handles."""
        return [t for h in list(self.handles.values()) if (t := h()) is not None]

    def listing(self) -> list[dict]:
        """``{shape, dtype, device, bytes}`` of each live handle (bytes: each rank's shard)."""
        return [describe(t) for t in self.live()]


def describe(t) -> dict:
    """``{shape, dtype, device, bytes}`` of a distributed tensor's handle (bytes: each rank's)."""
    size, _stride, _off, dtype, device, _rg = t._meta
    n = 1
    for s in size:
        n *= s
    return {"shape": list(size), "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "bytes": n * dtype.itemsize}


def encode_value(obj):
    """``obj`` with its distributed tensors as ``Ref`` (lists, tuples and dicts looked into)."""
    from .tensor import Tensor

    t = type(obj)
    if t is Tensor:
        return obj._r
    if t in (list, tuple):
        return t(encode_value(x) for x in obj)
    if t is dict:
        return {k: encode_value(v) for k, v in obj.items()}
    return obj


def _encode(batch: list) -> bytes:
    """The C pickler when it can (several times faster); cloudpickle for functions defined in
    a notebook or ``__main__``, which the ranks cannot import."""
    try:
        data = pickle.dumps(batch, protocol=5)
        if b"__main__" not in data:
            return data
    except Exception:  # noqa: BLE001  (a lambda, a local class: cloudpickle pickles those by value)
        pass
    import cloudpickle

    return cloudpickle.dumps(batch, protocol=5)
