"""Recording torch calls: the ``TorchFunctionMode`` that ``activate()`` pushes, and what it
does with a call that makes or touches distributed tensors.

A call's results' metadata is its ``plan`` (``plans.py``, cached), so a repeated call only
makes handles and appends one message.  Which leaf handles a result's autograd graph reaches
is tracked beside it (``_leaves``), so that ``loss.backward()`` knows whose ``.grad`` it
makes without a graph on the controller.
"""

from __future__ import annotations

import operator

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode

from ..messages import BACKWARD, OP, SET_ATTR
from .borrows import check_use, mutates
from .meshes import TensorMesh, state
from .plans import ATOMS, FACTORIES, SEQUENCES, call_name, plan_of
from .tensor import GRAD, LOCAL, VALUE_FUNCS, Tensor, value_error
from .tensor import LEAF as _LEAF

_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}


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
        raise ValueError(f"{call_name(func)}(): distributed tensors nested this deep in the arguments are not found; "
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
            raise ValueError(f"{call_name(func)}(): a tensor of mesh {t._mesh.describe()} used with one of mesh "
                             f"{mesh.describe()}; an op runs on one mesh: move one of them there first with "
                             "t.to_mesh(mesh)")
        if t._stream is not stream or t._access is not None:
            check_use(t, stream, f"{call_name(func)}()", mutates(func, args, kwargs, t))
    if func in VALUE_FUNCS:
        raise value_error(func)
    local = _local_tensor(args, kwargs)
    if local is not None:
        shape = list(local.shape)
        raise ValueError(f"{call_name(func)}(): a local tensor (shape {shape}, on the controller) used with a "
                         f"distributed one of mesh {mesh.describe()}; send it to the ranks first (inside "
                         "`with procs.activate():`, torch.as_tensor(x) makes it a distributed tensor), or fetch a "
                         "shard with inspect(t) to compute here")
    if func in _BACKWARD:
        return backward(mesh, *args, **kwargs)
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return set_attr(mesh, func.__self__.__name__, *args)
    return record(mesh, func, args, kwargs, tensors, deep)


def _find(args, kwargs) -> tuple[list, bool]:
    """The distributed tensors among the arguments, and whether any sits deeper than the
    top level of ``args`` (then the rank resolves refs everywhere)."""
    found = []
    deep = False
    for a in args:
        t = type(a)
        if t is Tensor:
            found.append(a)
        elif t in SEQUENCES:
            for x in a:
                if type(x) is Tensor:
                    found.append(x)
                    deep = True
    for a in kwargs.values():
        t = type(a)
        if t is Tensor:
            found.append(a)
            deep = True
        elif t in SEQUENCES:
            for x in a:
                if type(x) is Tensor:
                    found.append(x)
                    deep = True
    return found, deep


def _local_tensor(args, kwargs):
    """The first plain ``torch.Tensor`` where ``_find`` looks, or None."""
    for a in (*args, *kwargs.values()):
        t = type(a)
        if t is Tensor or t in ATOMS:
            continue
        if t in SEQUENCES:
            for x in a:
                if type(x) is not Tensor and isinstance(x, torch.Tensor):
                    return x
        elif isinstance(a, torch.Tensor):
            return a
    return None


# ---------------------------------------------------------------- recording


def record(mesh: TensorMesh, func, args, kwargs, tensors: list, deep: bool):
    grad = torch.is_grad_enabled()
    plan = plan_of(func, args, kwargs, tensors, grad)
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
