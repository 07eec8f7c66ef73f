"""``@remote``: a function that runs on every rank of a mesh.  Called, it is recorded like a
torch op, on the mesh of its first distributed tensor argument (else the active mesh), and
yields distributed tensors (their shapes from ``propagate``); ``fn.call(...)`` returns a
Future of a ValueMesh of its values; and ``send(fn, args, kwargs, port)`` has every rank
send its value to a port.

Example::

    @remote(propagate=lambda x: x)
    def double(x):
        return 2 * x

    with procs.activate():
        y = double(torch.ones(3))          # a distributed tensor
        print(check_memory.call().get())   # a ValueMesh, one value per rank
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..messages import OP, PROMISE
from .borrows import check_use
from .fetch import _raise_poisoned
from .meshes import TensorMesh, active, mesh_of, state
from .recorder import _find, build
from .tensor import Tensor, fake_of, meta_of


class FunctionByPath:
    """A function named ``"package.module.name"``, imported where it runs."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def resolve(self):
        module, _, name = self.path.rpartition(".")
        if not module:
            raise ValueError(f"remote({self.path!r}): name a function as 'package.module.function'")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __reduce__(self):
        return (FunctionByPath, (self.path,))

    def __repr__(self) -> str:
        return self.path


def _need_mesh(what: str) -> TensorMesh:
    mesh = active()
    if mesh is None:
        raise ValueError(f"calling the remote function {what} needs an active mesh: `with procs.activate():`")
    return mesh


class Remote:
    """What ``@remote`` makes.  Calling it inside ``activate()`` runs it on every rank and
    returns distributed tensors; ``call()``/``call_one()`` fetch its values."""

    def __init__(self, function, propagate=None):
        self.function = FunctionByPath(function) if isinstance(function, str) else function
        self.propagate = propagate
        functools.update_wrapper(self, function) if callable(function) else None

    @property
    def name(self) -> str:
        return getattr(self.function, "__qualname__", None) or repr(self.function)

    def __call__(self, *args, **kwargs):
        # As Monarch's: on the mesh of the first distributed tensor passed; else the active one.
        mesh = mesh_of([args, kwargs]) or _need_mesh(self.name)
        return record_call(mesh, self.function, self._outputs(mesh, args, kwargs), args, kwargs)

    rref = __call__

    def _outputs(self, mesh: TensorMesh, args, kwargs):
        """The function's results as meta tensors (or other values), from ``propagate``."""
        p = self.propagate
        if p == "inspect":
            fut = mesh.client.request(mesh.ranks[0], _described(self.function), args, kwargs, _raise_poisoned)
            return fut.get()
        fargs, fkwargs = _fakes(args), _fakes(kwargs)
        fn = self.function if p is None else p
        if isinstance(fn, FunctionByPath):
            fn = fn.resolve()
        from .meshes import no_mesh

        with no_mesh.activate(), torch.device("meta"):
            return fn(*fargs, **fkwargs)

    def call(self, *args, **kwargs):
        """Run on every rank of the active mesh: a Future of the ValueMesh of its values."""
        mesh = _need_mesh(self.name)
        return mesh.client.request_all(mesh.shape, self.function, args, kwargs, _raise_poisoned)

    def call_one(self, *args, **kwargs):
        """Run on the active mesh's only rank: a Future of its value."""
        mesh = _need_mesh(self.name)
        if len(mesh.ranks) != 1:
            raise ValueError(f"call_one needs a mesh of one rank; {mesh.describe()} has {len(mesh.ranks)}: "
                             "activate a slice of it, or use call()")
        return mesh.client.request(mesh.ranks[0], self.function, args, kwargs, _raise_poisoned)

    def __repr__(self) -> str:
        return f"<remote {self.name}>"


def remote(function=None, *, propagate=None):
    """Make ``function`` (or ``"module.path.name"``) a remote function; ``propagate``: a
    function of the arguments' fake (meta) tensors that returns fakes shaped like the
    results, or ``"inspect"`` (run it once on the first rank to learn them).

    Example::

        @monarch.remote(propagate=lambda t: t)
        def double(t):
            return t * 2

        with procs.activate():
            u = double(torch.ones(3))
    """
    if function is None:
        return functools.partial(remote, propagate=propagate)
    return Remote(function, propagate)


def send(fn, args=(), kwargs=None, port=None, selection: str = "all") -> None:
    """Run ``fn`` (a remote function) on every rank of the active mesh; each sends its value
    to ``port`` (a ``Port``) when one is given."""
    mesh = _need_mesh(getattr(fn, "name", repr(fn)))
    function = getattr(fn, "function", fn)
    kwargs = kwargs or {}
    if port is None:
        record_call(mesh, function, None, args, kwargs)
        return
    mesh.client.send_to_port(mesh.shape, function, args, kwargs, port)


def record_call(mesh: TensorMesh, function, outputs, args, kwargs, autograd: bool = False):
    """Record ``function(*args, **kwargs)`` on every rank of ``mesh``; ``outputs``: its
    results as fakes (each becomes a new distributed tensor) or plain values.  ``autograd``:
    results that need grad reach the inputs' leaves (``loss.backward()`` gives those grads)."""
    from .client import encode_value

    tensors, _deep = _find(args, kwargs)
    for t in tensors:
        if not t._mesh.same(mesh):
            raise ValueError(f"a tensor of mesh {t._mesh.describe()} passed to a remote function on "
                             f"{mesh.describe()}; move it with t.to_mesh(other)")
        if t._stream is not state.stream or t._access is not None:
            check_use(t, state.stream, f"{getattr(function, '__name__', 'a remote function')}()", False)
    device = tensors[0].device if tensors else torch.device("cpu")
    plan = _plan_new(outputs, device)
    client = mesh.client
    made: list[int] = []
    rg_inputs = [t for t in tensors if t._meta[5]] if autograd and torch.is_grad_enabled() else ()
    result, out = build(plan, tensors, rg_inputs, mesh, client, made)
    client.record((OP, function, encode_value(tuple(args)), encode_value(kwargs), out, True), made, mesh.rank_set,
                  torch.is_grad_enabled())
    return result


def _plan_new(o, device):
    if isinstance(o, torch.Tensor):
        return ("t", meta_of(o, device=device if o.device.type == "meta" else o.device), -1)
    if isinstance(o, _Described):
        return ("t", o.meta, -1)
    if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
        return ("s", type(o), tuple(_plan_new(x, device) for x in o))
    return ("c", o)


def _fakes(obj):
    if type(obj) is Tensor:
        return fake_of(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fakes(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _fakes(v) for k, v in obj.items()}
    return obj


class _Described:
    """A rank's tensor result told to the controller as its metadata only."""

    __slots__ = ("meta",)

    def __init__(self, meta: tuple):
        self.meta = meta

    def __reduce__(self):
        return (_Described, (self.meta,))


def _describe(value):
    if isinstance(value, torch.Tensor):
        return _Described(meta_of(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(v) for v in value)
    return value


def _described(function):
    return functools.partial(_run_described, function)


def _run_described(function, *args, **kwargs):
    return _describe(function(*args, **kwargs))


def rank_tensor(mesh: TensorMesh, dim: str) -> Tensor:
    """A 0-dim int64 distributed tensor: each rank's index along ``dim``."""
    from ..rank.values import coordinate

    if dim not in mesh.labels:
        raise ValueError(f"the mesh {mesh.describe()} has no dimension {dim!r}; its dimensions are "
                         f"{', '.join(mesh.labels) or 'none'}")
    from .meshes import no_mesh

    with no_mesh.activate():
        fake = torch.empty((), dtype=torch.int64, device="meta")
    return record_call(mesh, coordinate, fake, (mesh.ranks, mesh.sizes, mesh.labels.index(dim)), {})


def rank_tensors(mesh: TensorMesh) -> dict:
    return {d: rank_tensor(mesh, d) for d in mesh.labels}


def promise(mesh: TensorMesh, propagate, args, kwargs):
    """``rref``: handles for what an actor's endpoint will return (shapes from ``propagate``
    of the arguments' fakes), promised to the ranks, and sent; returns them and their refs."""
    from .meshes import no_mesh

    fargs, fkwargs = _fakes(args), _fakes(kwargs)
    with no_mesh.activate(), torch.device("meta"):
        outputs = propagate(*fargs, **fkwargs)
    tensors, _deep = _find(args, kwargs)
    device = tensors[0].device if tensors else torch.device("cpu")
    client = mesh.client
    made: list[int] = []
    result, out = build(_plan_new(outputs, device), tensors, (), mesh, client, made)
    client.record((PROMISE, made), made, mesh.rank_set, torch.is_grad_enabled())
    client.flush()
    return result, out
