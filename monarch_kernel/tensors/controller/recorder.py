"""Recording torch calls: the ``TorchFunctionMode`` that ``activate()`` pushes, and what it
does with a call that makes or touches distributed tensors.

A call's results' metadata comes from running it on meta tensors, once per (function,
argument metadata, grad mode): meta kernels cost up to milliseconds, so a ``plan`` of the
results is cached and a repeated call only makes handles and appends one message.  Which
leaf handles a result's autograd graph reaches is tracked beside it (``_leaves``), so that
``loss.backward()`` knows whose ``.grad`` it makes without a graph on the controller.
"""

from __future__ import annotations

import operator

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode

from ..messages import BACKWARD, OP, SET_ATTR
from .borrows import check_use, mutates
from .meshes import TensorMesh, state
from .tensor import GRAD, LOCAL, VALUE_FUNCS, Tensor, fake_of, value_error
from .tensor import LEAF as _LEAF

FACTORIES = {torch.rand, torch.randn, torch.randint, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor, torch.as_tensor,
             torch.randperm, torch.empty_strided, torch.scalar_tensor}
_ATOMS = (int, float, bool, str, complex, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_SEQ = (list, tuple)
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}
_CACHE: dict = {}
_CACHE_LIMIT = 8192


class _Uncacheable(Exception):
    pass


class RecordingMode(TorchFunctionMode):
    """Pushed by ``activate()``: factory calls make distributed tensors on the active mesh."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in LOCAL:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tensors, deep = _find(args, kwargs)
        if not tensors:
            mesh = state.mesh
            if mesh is not None and func in FACTORIES:
                return record(mesh, func, args, kwargs, tensors, False)
            return func(*args, **kwargs)
        return dispatch(func, args, kwargs, tensors, deep)


def on_own_mesh(func, args, kwargs):
    """A torch call on distributed tensors outside ``activate()`` (or inside ``no_mesh``)."""
    tensors, deep = _find(args, kwargs)
    if not tensors:
        raise ValueError(f"{_name(func)}(): distributed tensors nested this deep in the arguments are not found; "
                         "pass them at the top level, or in a list or tuple there")
    return dispatch(func, args, kwargs, tensors, deep)


def dispatch(func, args, kwargs, tensors: list, deep: bool):
    """Record ``func`` on the mesh of its first distributed tensor, as Monarch's dispatch
    does: the active mesh matters only to calls that pass none (factories).  Every other
    distributed tensor must live there too, and no local tensor may be mixed in."""
    mesh = tensors[0]._mesh
    stream = state.stream
    for t in tensors:
        if t._mesh is not mesh and not t._mesh.same(mesh):
            raise ValueError(f"{_name(func)}(): a tensor of mesh {t._mesh.describe()} used with one of mesh "
                             f"{mesh.describe()}; an op runs on one mesh: move one of them there first with "
                             "t.to_mesh(mesh)")
        if t._stream is not stream or t._access is not None:
            check_use(t, stream, f"{_name(func)}()", mutates(func, args, kwargs, t))
    if func in VALUE_FUNCS:
        raise value_error(func)
    local = _local_tensor(args, kwargs)
    if local is not None:
        shape = list(local.shape)
        raise ValueError(f"{_name(func)}(): a local tensor (shape {shape}, on the controller) used with a "
                         f"distributed one of mesh {mesh.describe()}; send it to the ranks first (inside "
                         "`with procs.activate():`, torch.as_tensor(x) makes it a distributed tensor), or fetch a "
                         "shard with inspect(t) to compute here")
    if func in _BACKWARD:
        return backward(mesh, *args, **kwargs)
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return set_attr(mesh, func.__self__.__name__, *args)
    return record(mesh, func, args, kwargs, tensors, deep)


def _name(func) -> str:
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        return f"Tensor.{func.__self__.__name__}"
    return getattr(func, "__name__", repr(func))


def _find(args, kwargs) -> tuple[list, bool]:
    """The distributed tensors among the arguments, and whether any sits deeper than the
    top level of ``args`` (then the rank resolves refs everywhere)."""
    found = []
    deep = False
    for a in args:
        t = type(a)
        if t is Tensor:
            found.append(a)
        elif t in _SEQ:
            for x in a:
                if type(x) is Tensor:
                    found.append(x)
                    deep = True
    for a in kwargs.values():
        t = type(a)
        if t is Tensor:
            found.append(a)
            deep = True
        elif t in _SEQ:
            for x in a:
                if type(x) is Tensor:
                    found.append(x)
                    deep = True
    return found, deep


def _local_tensor(args, kwargs):
    """The first plain ``torch.Tensor`` where ``_find`` looks, or None."""
    for a in (*args, *kwargs.values()):
        t = type(a)
        if t is Tensor or t in _ATOMS:
            continue
        if t in _SEQ:
            for x in a:
                if type(x) is not Tensor and isinstance(x, torch.Tensor):
                    return x
        elif isinstance(a, torch.Tensor):
            return a
    return None


# ---------------------------------------------------------------- plans (results' metadata)


def _sig(a):
    t = type(a)
    if t is Tensor:
        return a._meta
    if t in _ATOMS:
        return (t, a)
    if t in _SEQ or t is torch.Size:
        return (t, tuple(_sig(x) for x in a))
    if t is slice:
        return (slice, _sig(a.start), _sig(a.stop), _sig(a.step))
    if t is torch.Tensor:
        return ("plain", tuple(a.size()), tuple(a.stride()), a.dtype, a.device, a.requires_grad)
    raise _Uncacheable


def _key(func, args, kwargs, grad: bool):
    sig: list = [func, grad]
    try:
        for a in args:
            t = type(a)
            if t is Tensor:
                sig.append(a._meta)
            elif t is int or t is float:
                sig.append((t, a))
            else:
                sig.append(_sig(a))
        if kwargs:
            sig.append(tuple((n, _sig(v)) for n, v in kwargs.items()))
    except _Uncacheable:
        return None
    return tuple(sig)


def _plan(func, args, kwargs, tensors: list):
    """Run ``func`` on meta tensors; describe its results: ("t", meta, alias index, device)
    per tensor (alias: the input handle it returns, in place), ("c", value) per constant,
    ("s", type, parts) per sequence."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(a):
        t = type(a)
        if t is Tensor:
            f = fakes.get(id(a))
            if f is None:
                f = fakes[id(a)] = fake_of(a)
            return f
        if t in _SEQ:
            return t(fake(x) for x in a)
        if t is torch.Tensor:
            return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device="meta",
                                       requires_grad=a.requires_grad)
        return a

    target = None
    fargs = [fake(a) for a in args]
    fkwargs = {k: fake(v) for k, v in kwargs.items()}
    if func in _MOVES:
        pass
    elif "device" in fkwargs:
        target = fkwargs["device"]
        fkwargs["device"] = "meta"
    elif func in FACTORIES:
        fkwargs["device"] = "meta"
    try:
        if func in _MOVES:
            target, out = _move(func, fargs, fkwargs, tensors)
        else:
            out = func(*fargs, **fkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        raise RuntimeError(f"{_name(func)}() has no meta implementation, so the controller cannot know the shape "
                           "of its result: compute it in a @remote function with propagate= (or "
                           "propagate='inspect')") from e
    device = torch.device(target) if target is not None else (tensors[0].device if tensors else
                                                               torch.device("cpu"))
    order = {id(t): i for i, t in enumerate(tensors)}
    first = {id(f): order[tid] for tid, f in fakes.items()}  # fake id -> index of its handle in `tensors`

    def describe(o):
        if isinstance(o, torch.Tensor):
            alias = first.get(id(o), -1)
            if alias < 0 and target is None and o.device.type != "meta":
                device_o = o.device
            else:
                device_o = device
            return ("t", (tuple(o.size()), tuple(o.stride()), o.storage_offset(), o.dtype, device_o,
                          o.requires_grad), alias)
        if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            return ("s", type(o), tuple(describe(x) for x in o))
        return ("c", o)

    return describe(out)


def _move(func, fargs, fkwargs, tensors):
    """``to``/``cuda``/``cpu`` on meta tensors: the device the result goes to (None: its
    own) and the result, which is the input itself when neither device nor dtype changes."""
    src = tensors[0].device
    target = fkwargs.pop("device", None)
    rest = fargs[1:]
    if func is torch.Tensor.cuda:
        idx = rest[0] if rest else None
        target = torch.device("cuda", idx) if isinstance(idx, int) else torch.device(idx or "cuda")
        rest = []
    elif func is torch.Tensor.cpu:
        target, rest = torch.device("cpu"), []
    else:
        kept = []
        for a in rest:
            if isinstance(a, (str, torch.device)):
                target = a
            else:
                kept.append(a)
        rest = kept
    if target is not None:
        target = torch.device(target)
        if target == src or (target.type == src.type and target.index is None):
            target = None
    x = fargs[0]
    out = x.to(*rest, **fkwargs) if (rest or fkwargs) else x
    if out is x and target is not None:
        out = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
    return target, out


# ---------------------------------------------------------------- recording


def record(mesh: TensorMesh, func, args, kwargs, tensors: list, deep: bool):
    grad = torch.is_grad_enabled()
    key = _key(func, args, kwargs, grad)
    plan = _CACHE.get(key) if key is not None else None
    if plan is None:
        plan = _plan(func, args, kwargs, tensors)
        if key is not None:
            if len(_CACHE) >= _CACHE_LIMIT:
                _CACHE.clear()
            _CACHE[key] = plan
    client = mesh.client
    made: list[int] = []
    rg_inputs = [t for t in tensors if t._meta[5]] if grad else ()
    result, out = build(plan, tensors, rg_inputs, mesh, client, made)
    name = getattr(func, "__name__", "")
    if name == "__get__":  # .T, .data, .real: their getters do not pickle
        func, args = operator.attrgetter(func.__self__.__name__), args[:1]
    enc = tuple([a._r if type(a) is Tensor else a for a in args])
    if deep:
        from .client import encode_value

        enc, kwargs = encode_value(enc), encode_value(kwargs)
    client.record((OP, func, enc, kwargs, out, deep), made, mesh.rank_set, grad)
    return result


def build(plan, tensors, rg_inputs, mesh, client, made):
    kind = plan[0]
    if kind == "t":
        meta, alias = plan[1], plan[2]
        if alias >= 0:
            t = tensors[alias]
            if meta[5] != t._meta[5] or (meta[5] and rg_inputs):
                _regrad(t, meta[5], rg_inputs)
            return t, t._ref
        ref = client.new_ref()
        t = Tensor(meta, mesh, ref)
        if meta[5]:
            t._leaves = _merge(rg_inputs) if rg_inputs else _LEAF
        client.adopt(t)
        made.append(ref)
        return t, ref
    if kind == "s":
        results, outs = [], []
        for p in plan[2]:
            r, o = build(p, tensors, rg_inputs, mesh, client, made)
            results.append(r)
            outs.append(o)
        return plan[1](results), tuple(outs)
    return plan[1], None


def _merge(rg_inputs) -> dict:
    leaves: dict = {}
    for t in rg_inputs:
        if t._leaves is _LEAF:
            leaves[id(t)] = t
        elif t._leaves:
            leaves.update(t._leaves)
    return leaves


def _regrad(t: Tensor, rg: bool, rg_inputs) -> None:
    """An in-place op changed whether ``t`` needs grad (``requires_grad_``), or folded
    inputs that need grad into it."""
    others = [x for x in rg_inputs if x is not t]
    if rg != t._meta[5]:
        with DisableTorchFunctionSubclass():
            torch.Tensor.requires_grad_(t, rg)
        t._meta = (*t._meta[:5], rg)
        t._leaves = (_merge(others) if others else _LEAF) if rg else None
    elif others:
        merged = _merge(others)
        if t._leaves is _LEAF:
            merged[id(t)] = t
        elif t._leaves:
            merged.update(t._leaves)
        t._leaves = merged


def backward(mesh: TensorMesh, loss: Tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None,
             **_ignored):
    """``loss.backward()``: on every rank; on the controller, each leaf the loss reaches
    gets a ``.grad`` handle (the same one again if it already has one) that the ranks
    bind to their leaf's ``.grad``."""
    if isinstance(loss, (list, tuple)):
        if len(loss) != 1:
            raise NotImplementedError("backward of several tensors at once: sum them first")
        loss = loss[0]
        gradient = gradient[0] if isinstance(gradient, (list, tuple)) else gradient
    if not loss._meta[5]:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    if gradient is None and loss.numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    leaves = [loss] if loss._leaves is _LEAF else list((loss._leaves or {}).values())
    client = mesh.client
    binds, made = [], []
    for p in leaves:
        with DisableTorchFunctionSubclass():
            g = GRAD.__get__(p)
        if g is None:
            ref = client.new_ref()
            size, stride, offset, dtype, device, _rg = p._meta
            g = Tensor((size, stride, offset, dtype, device, False), mesh, ref)
            client.adopt(g)
            made.append(ref)
            with DisableTorchFunctionSubclass():
                GRAD.__set__(p, g)
        binds.append((p._ref, g._ref))
    gref = gradient._r if type(gradient) is Tensor else gradient
    client.record((BACKWARD, loss._ref, gref, bool(retain_graph or create_graph), binds), made, mesh.rank_set,
                  torch.is_grad_enabled())


def set_attr(mesh: TensorMesh, name: str, target: Tensor, value) -> None:
    """``t.grad = g`` / ``t.requires_grad = b`` / ``t.data = u``: on the ranks too."""
    if type(target) is not Tensor:
        raise TypeError(f"setting .{name} of a plain tensor to a distributed one: make both distributed")
    if name == "grad":
        if value is not None and (type(value) is not Tensor or value._meta[:5] != (*target._meta[:4], target.device)):
            raise RuntimeError("assigned grad has data of a different size, type or mesh")
        with DisableTorchFunctionSubclass():
            GRAD.__set__(target, value)
    elif name == "requires_grad":
        _regrad(target, bool(value), ())
    elif name == "data":
        if type(value) is not Tensor or value._meta[:5] != target._meta[:5]:
            raise NotImplementedError("t.data = u on a distributed tensor needs u of t's shape, strides, dtype "
                                      "and device (else make a new tensor)")
    else:
        raise NotImplementedError(f"setting .{name} of a distributed tensor")
    enc = value._r if type(value) is Tensor else value
    mesh.client.record((SET_ATTR, target._ref, name, enc), [], mesh.rank_set, torch.is_grad_enabled())


def rebind_on(obj, old: TensorMesh, new: TensorMesh):
    """``slice_mesh``: new handles on ``new``'s ranks for the same shards."""
    def one(t):
        if type(t) is Tensor:
            ref = new.client.new_ref()
            h = Tensor(t._meta, new, ref)
            h._leaves = t._leaves
            new.client.adopt(h)
            new.client.record((OP, _same_tensor, (t._r,), {}, ref, False), [ref], new.rank_set,
                              torch.is_grad_enabled())
            return h
        if isinstance(obj, (list, tuple)):
            return type(t)(one(x) for x in t)
        if isinstance(t, dict):
            return {k: one(v) for k, v in t.items()}
        return t

    return one(obj)


def _same_tensor(t):
    return t
