"""A torch call's ``plan``: its results' metadata, from running it on meta tensors once per
(function, argument metadata, grad mode).  Meta kernels cost up to milliseconds, so plans
are cached; a plan never holds a distributed tensor, only the index of the input a result
aliases.  It never records or sends anything (``recorder.py`` does).
"""

from __future__ import annotations

import torch

from .tensor import Tensor, fake_of

FACTORIES = {torch.rand, torch.randn, torch.randint, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor, torch.as_tensor,
             torch.randperm, torch.empty_strided, torch.scalar_tensor}
ATOMS = (int, float, bool, str, complex, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
         torch.memory_format)
SEQUENCES = (list, tuple)
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_CACHE: dict = {}
_CACHE_LIMIT = 8192


class _Uncacheable(Exception):
    pass


def call_name(func) -> str:
    """The torch call's name as messages say it (``Tensor.grad`` for an attribute)."""
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        return f"Tensor.{func.__self__.__name__}"
    return getattr(func, "__name__", repr(func))


def plan_of(func, args, kwargs, tensors: list, grad: bool):
    """``func``'s plan for these arguments (``tensors``: the distributed ones among them),
    from the cache when a call like it was planned before."""
    key = _key(func, args, kwargs, grad)
    plan = _CACHE.get(key) if key is not None else None
    if plan is None:
        plan = _plan(func, args, kwargs, tensors)
        if key is not None:
            if len(_CACHE) >= _CACHE_LIMIT:
                _CACHE.clear()
            _CACHE[key] = plan
    return plan


def _sig(a):
    t = type(a)
    if t is Tensor:
        return a._meta
    if t in ATOMS:
        return (t, a)
    if t in SEQUENCES or t is torch.Size:
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
        if t in SEQUENCES:
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
        raise RuntimeError(f"{call_name(func)}() has no meta implementation, so the controller cannot know the shape "
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
