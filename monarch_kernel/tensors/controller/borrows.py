"""The rules a distributed tensor's stream and borrows put on its use, checked on the
controller at the line that breaks them (a ``RuntimeError``: a ``TypeError`` raised inside
``t + 1`` would turn into Python's own "unsupported operand"), so the ranks never race:

- a tensor is used on the stream it was made on (or borrowed to);
- while borrowed mutably, its own stream may not use it; while borrowed read-only, neither
  stream may write to it;
- a borrowed handle is not used after its ``borrow.drop()``.

Pure bookkeeping: no torch, no messages.
"""

from __future__ import annotations

_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                              "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__", "__setitem__", "__set__"})


class Access:
    """How a lent tensor may be used on its own stream: ``mode`` "r" (read only) or ""
    (not at all), for as long as ``borrows`` are live."""

    __slots__ = ("mode", "borrows")

    def __init__(self, mode: str):
        self.mode = mode
        self.borrows: list = []


DROPPED = Access("dropped")  # the ``_access`` of a borrowed handle after its drop()


def stream_name(stream) -> str:
    return "the main stream" if stream is None else f"stream {stream.name!r}"


def mutates(func, args, kwargs, t) -> bool:
    """Whether ``func(*args, **kwargs)`` writes to ``t`` (in-place ops, ``out=``, setters)."""
    out = kwargs.get("out") if kwargs else None
    if out is not None and (out is t or (isinstance(out, (list, tuple)) and any(x is t for x in out))):
        return True
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
        a0 = args[0] if args else None
        return a0 is t or (isinstance(a0, (list, tuple)) and any(x is t for x in a0))
    return False


def check_use(t, stream, what: str, writes: bool) -> None:
    """Raise, saying how to fix it, if ``t`` may not be used (``writes``: written) on ``stream``."""
    acc = t._access
    if acc is DROPPED:
        raise RuntimeError(f"{what}: this tensor was borrowed to {stream_name(t._stream)} and the borrow was "
                           "dropped; a borrowed tensor is not used after borrow.drop() (use the original on its own "
                           "stream)")
    if t._stream is not stream:
        where = "main.activate()" if t._stream is None else f"{t._stream.name}.activate()"
        raise RuntimeError(f"{what}: a tensor of {stream_name(t._stream)} used on {stream_name(stream)}; run this "
                           f"inside `with {where}:`, or borrow the tensor for this stream first "
                           "(`t2, borrow = stream.borrow(t)`)")
    if acc is None:
        return
    lenders = ", ".join(sorted({stream_name(b.stream) for b in acc.borrows}))
    if acc.mode == "":
        raise RuntimeError(f"{what}: this tensor is borrowed mutably by {lenders}, so its own stream may not use "
                           "it until that borrow.drop()")
    if writes:
        raise RuntimeError(f"{what} writes to a tensor borrowed read-only by {lenders}; borrow it with "
                           "mutable=True, or write to it after borrow.drop()")
