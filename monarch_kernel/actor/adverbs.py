"""The adverbs that call an actor's endpoint on a mesh: ``call``, ``call_one``,
``broadcast``, ``choose``, ``stream``, ``rref`` (``Endpoint``, what ``mesh.method`` is), and
how a call's arguments go out and its answers come back as values or errors.

Example::

    trainers.step.call(3).get()      # ValueMesh, one value per rank
    trainers.slice(gpus=0).step.call_one(3).get()
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..runtime import (
    ActorError,
    CallInfo,
    MeshFailure,
    MeshStopped,
    Mode,
    Part,
    ProcessDied,
    Runtime,
    SendFailed,
    Status,
    actor_path,
    describe_unpicklable,
    dumps,
    dumps_plain,
)
from . import self_healing, tensor_shim
from .future import Future
from .stream import Stream
from .value_mesh import ValueMesh

if TYPE_CHECKING:
    from .actor_mesh import ActorMesh

_calls_sent: dict[tuple[str, int], int] = {}  # (proc mesh id, thread) -> calls sent (a new call is progress)
_sent_total = 0  # calls and broadcasts sent by this process, to any mesh, from any thread


def calls_sent(mesh_id: str, thread: int) -> int:
    """How many calls (answered ones, not ``broadcast``) thread ``thread`` (its ident) has
    sent to the ranks of proc mesh ``mesh_id``: the hang watchdog counts a new call from the
    thread it watches as progress."""
    return _calls_sent.get((mesh_id, thread), 0)


def sends_total() -> int:
    """How many calls and broadcasts this process has sent, to any mesh from any thread: a
    cell whose only send was its ``%%mesh`` run, its output already in by the ranks' end
    markers, need not drain the ranks' pipes at its end."""
    return _sent_total


def part_value(part: Part, actor: str, method: str) -> Any:
    """Turn one rank's encoded answer into its value, or raise what happened there."""
    if part.status == Status.OK:
        return part.load()
    if part.status == Status.RAISED:
        failure = part.load()
        err = ActorError(failure)
        cause = failure.exception()
        if cause is not None:
            err.__cause__ = cause
        raise err
    info = part.load()
    if part.status == Status.UNSENT:
        raise SendFailed(f"{actor}.{method} never reached rank {part.rank}: {info}")
    if part.status == Status.STOPPED or info.stopped:
        raise MeshStopped(f"mesh '{info.mesh}' was stopped; rank {info.rank} cannot answer {actor}.{method}. "
                          "Spawn a new mesh.")
    raise ProcessDied(info, actor, method)


def encode_args(what: str, args, kwargs) -> list:
    try:
        return dumps((args, kwargs))
    except Exception as e:
        bad = next((a for a in (*args, *kwargs.values()) if not _picklable(a)), (args, kwargs))
        raise TypeError(f"an argument to {what} cannot be sent to the ranks: {describe_unpicklable(bad, e)}") from e


def _picklable(obj) -> bool:
    try:
        dumps(obj)
        return True
    except Exception:
        return False


class Endpoint:
    """One endpoint of an actor mesh; its adverbs send the call.

    Example: ``trainers.step.call(8).get()``, a ValueMesh of every rank's answer::

        trainers.step.choose(8).get()      # one rank, picked for you
    """

    def __init__(self, mesh: ActorMesh, name: str):
        self._mesh = mesh
        self._name = name

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh._class_name}.{self._name} on {self._mesh.extent!r}>"

    def _send(self, args, kwargs, ranks, *, mode=Mode.GATHER, on_part=None, slice_info=None, callbacks=False):
        global _sent_total
        m = self._mesh
        ref = m._proc_ref  # as of now (a moved rank's new address): once per call
        key = (ref.id, threading.get_ident())
        _calls_sent[key] = _calls_sent.get(key, 0) + 1
        _sent_total += 1
        rt = m._check_running()
        body = dumps_plain((args, kwargs))
        if body is not None:  # scalars: nothing to put in shared memory
            return rt.call(ref, m._actor_id, self._name, ranks, body, mode=mode,
                           on_part=on_part, slice_info=slice_info, callbacks=callbacks)
        what = f"{m._class_name}.{self._name}"
        hosts = ref.hosts
        with tensor_shim.pinned_for(ref.id) as handles:  # the distributed tensors pickled, if any
            if rt.shares_memory() and all(hosts[r] == rt.host for r in ranks):
                # Same host: large arrays and tensors go through shared memory.
                with rt.tracking_segments() as created:
                    body = encode_args(what, args, kwargs)
            else:
                body, created = encode_args(what, args, kwargs), None
        try:
            pending = rt.call(ref, m._actor_id, self._name, list(ranks), body, mode=mode,
                              on_part=on_part, slice_info=slice_info, callbacks=callbacks, segments=created)
        except BaseException:
            if created:
                rt.unlink_segments(created)
            raise
        if handles:
            # The distributed tensors in the arguments live until the call is answered: a
            # temporary's delete would otherwise race the endpoint's lookup of its shard.
            pending.completion.add_done_callback(lambda _c, keep=handles: keep.clear())
        return pending

    def _slice_info(self, broadcast: bool = False) -> CallInfo:
        """The called slice, so that each rank knows its point in it (``context()``)."""
        m = self._mesh
        s = m._shape
        info = m._call_info  # made once per mesh (slices are meshes of their own)
        if info is None:
            info = m._call_info = CallInfo(tuple(zip(s.extent.labels, s.extent.sizes, strict=True)), tuple(s.ranks))
        return info._replace(broadcast=True) if broadcast else info

    def _answers(self, args, kwargs, ranks) -> tuple:
        """Send the call: ``(completion, inbox)`` for its Future; re-sent to replaced ranks (``retries``)."""
        retries, info = self._mesh._retries.get(self._name, 0), self._slice_info()
        healer = self_healing.existing(mesh_id := self._mesh._proc_ref.id) if retries else None
        if healer is None or not healer.policy.on_failure:
            pending = self._send(args, kwargs, ranks, slice_info=info)
            return pending.completion, pending.inbox
        send = lambda rs: self._send(args, kwargs, rs, slice_info=info, callbacks=True)  # noqa: E731
        return self_healing.retried(mesh_id, list(ranks), retries, send), None

    def call(self, *args, **kwargs) -> Future[ValueMesh]:
        """Run on every rank of the mesh; a ``ValueMesh`` of the answers.  If a rank fails,
        ``.get()`` raises its error; ``err.results`` holds every rank's value or exception."""
        shape = self._mesh._shape
        completion, inbox = self._answers(args, kwargs, shape.ranks)
        actor, name = self._mesh._class_name, self._name

        def gather(parts):
            values, first = [], None
            for r in shape.ranks:
                try:
                    values.append(part_value(parts[r], actor, name))
                except (ActorError, MeshStopped, SendFailed) as e:
                    values.append(e)
                    first = first or e
            if first is not None:
                first.results = ValueMesh(shape, values)
                raise first
            return ValueMesh(shape, values)

        return Future(completion, gather, inbox)

    def call_one(self, *args, **kwargs) -> Future:
        """Run on the mesh's only rank; an error unless the mesh has exactly one."""
        shape = self._mesh._shape
        if len(shape.ranks) != 1:
            first = shape.extent.labels[0] if shape.extent.labels else "dim"
            raise ValueError(
                f"call_one needs a mesh of exactly one rank; this one has {len(shape)} "
                f"({shape.extent.describe()}). Slice it first, e.g. "
                f"mesh.slice({first}=0).{self._name}.call_one(...)"
            )
        return self._one(shape.ranks[0], args, kwargs)

    def _one(self, rank: int, args, kwargs) -> Future:
        completion, inbox = self._answers(args, kwargs, [rank])
        actor, name = self._mesh._class_name, self._name
        return Future(completion, lambda parts: part_value(parts[rank], actor, name), inbox)

    def choose(self, *args, **kwargs) -> Future:
        """Run on one rank: the one with the fewest of this process's calls in flight."""
        return self._one(self._chosen_rank(), args, kwargs)

    def _chosen_rank(self) -> int:
        m = self._mesh
        rt = Runtime.current()
        busy = rt.calls_waiting_on(m._proc_ref.id)
        alive = [r for r in m._shape.ranks if rt.death(m._proc_ref.id, r) is None] or list(m._shape.ranks)
        return min(alive, key=lambda r: busy.get(r, 0))

    def broadcast(self, *args, **kwargs) -> None:
        """Run on every rank without waiting.  Failures go to supervision (the actor mesh's
        owner), not to you, and an exception that escapes the endpoint stops that actor."""
        self._fire(self._mesh._shape.ranks, args, kwargs)

    def _send_selected(self, args, kwargs, port, selection: str) -> None:
        """Monarch's ``send(endpoint, args, kwargs, port, selection)``: ``broadcast`` to every
        rank (``"all"``) or to the one ``choose`` would take (``"choose"``); with ``port``,
        each rank's value is sent there once it answers (a failure, as ``port.exception``)."""
        if selection not in ("all", "choose"):
            raise ValueError(f"send(..., selection={selection!r}): the selection is 'all' or 'choose'")
        ranks = self._mesh._shape.ranks if selection == "all" else [self._chosen_rank()]
        if port is None:
            self._fire(ranks, args, kwargs)
            return
        pending = self._send(args, kwargs, list(ranks), slice_info=self._slice_info())
        actor, name = self._mesh._class_name, self._name

        def forward(c) -> None:
            for part in c.result().values():
                try:
                    value = part_value(part, actor, name)
                except (ActorError, MeshStopped, SendFailed) as e:
                    port.exception(e)
                else:
                    port.send(value)

        pending.completion.add_done_callback(forward)

    def _fire(self, ranks, args, kwargs) -> None:
        m = self._mesh
        info = self._slice_info(broadcast=True)  # fire and forget: an escaping exception stops the actor
        pending = self._send(args, kwargs, ranks, slice_info=info, callbacks=True)
        actor, name, mesh_id = m._class_name, self._name, m._proc_ref.id
        owner = m._owner

        def report(failure) -> None:  # to whoever spawned the actor mesh, when known here
            rt = Runtime.current()
            if owner is not None:
                rt.report_failure_to(owner[0], failure)
            else:
                rt.report_failure(mesh_id, failure)

        def check(c):  # one event per actor that failed (each of them stopped), as in Monarch
            for rank, part in c.result().items():
                if part.status == Status.RAISED:
                    try:
                        part_value(part, actor, name)
                    except ActorError as e:
                        cls = f"{m._class_module}.{actor}" if m._class_module else actor
                        path = actor_path(owner[0] if owner else None, cls, m._actor_id, rank, m._proc_ref.dims)
                        report(MeshFailure(m._proc_ref.name, rank, str(e), remote=e.failure, actor=path))
                elif part.status == Status.UNSENT:  # nobody waits for a broadcast: supervision hears
                    what = f"broadcast of {actor}.{name} never reached rank {rank}: {part.load()}"
                    report(MeshFailure(m._proc_ref.name, rank, what))
                    return  # the first unreachable rank says it for the rest

        pending.completion.add_done_callback(check)

    def tell(self, *args, **kwargs) -> None:
        """``broadcast`` for a stream of messages: nothing comes back, not even the answers
        ``broadcast`` checks, so each costs every rank one message and this process one
        send per rank (straight to each, not down the tree).  An exception that escapes the
        endpoint stops that actor, and the rank itself reports it to supervision.  Arguments
        are pickled into the message (never shared memory, which nobody would free)."""
        self.tell_to(self._mesh._shape.ranks, *args, **kwargs)

    def tell_to(self, ranks, *args, **kwargs) -> None:
        """``tell`` to some of the mesh's ranks only (proc-mesh ranks, in the order given)."""
        m = self._mesh
        rt = m._check_running()
        body = dumps_plain((args, kwargs)) or encode_args(f"{m._class_name}.{self._name}", args, kwargs)
        rt.tell(m._proc_ref, m._actor_id, self._name, list(ranks), body, self._slice_info(broadcast=True))

    def rref(self, *args, **kwargs):
        """Run on every rank; the result stays there as a distributed tensor (its shape from
        ``@endpoint(propagate=...)``), usable at once in ``activate()`` code::

            o = torch.relu(linear.forward.rref(t))
        """
        m = self._mesh
        propagate = (m._propagators or {}).get(self._name)
        if propagate is None:
            raise ValueError(f"{m._class_name}.{self._name}.rref(...) needs its result's shape: declare it with "
                             f"@endpoint(propagate=lambda *args: ...) (a function of the arguments' fake tensors)")
        return tensor_shim.tensors().rref(m, self._name, propagate, m._proc_mesh, args, kwargs)

    def stream(self, *args, **kwargs) -> Stream:
        """Run on every rank; one Future per rank, in the order they answer.  Iterate it
        (``for fut in ...``) anywhere, an async endpoint included (that actor waits, as in
        Monarch), or ``async for fut in ...`` in async code, which never blocks its loop."""
        shape = self._mesh._shape
        actor, method = self._mesh._class_name, self._name
        stream = Stream(len(shape), lambda part: part_value(part, actor, method))
        self._send(args, kwargs, shape.ranks, mode=Mode.DIRECT, on_part=stream.arrived, slice_info=self._slice_info())
        return stream
