"""A backward pass run a gradient at a time, on a rank (``grad_generator``).

torch runs a backward pass to its end in one call.  Here it runs on a thread of its own,
with a hook on each input whose gradient is asked for; a hook that has made the gradient
the stream waits for hands it over and pauses the pass until the next one is asked for.
So the main stream computes exactly as much of the backward as the gradients it has asked
for need (in the order the controller recorded), and a comms stream can reduce one
gradient while the next is computed.  A pass whose session is deleted before its end is
stopped (its hooks raise), never left running.
"""

from __future__ import annotations

import functools
import threading

import torch


class _Stopped(Exception):
    pass


class LazyBackward:
    """The gradients of ``roots`` with respect to each of ``wrt``, made when asked for."""

    def __init__(self, roots, wrt, grad_roots):
        self.roots = list(roots)
        self.wrt = list(wrt)
        self.grad_roots = list(grad_roots) if grad_roots else None
        self._got: dict[int, torch.Tensor] = {}  # made, not yet taken
        self._made: set[int] = set()
        self._want: int | None = None
        self._needed = [i for i, w in enumerate(self.wrt) if isinstance(w, torch.Tensor) and w.requires_grad]
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._stopped = False
        self._error: BaseException | None = None

    def get(self, index: int) -> torch.Tensor:
        """Gradient ``index``: computed as far as it needs (zeros where the input is unused)."""
        with self._cond:
            if index in self._made and index not in self._got:
                raise RuntimeError(f"gradient {index} of this grad_generator was already taken")
            if index not in self._got and not self._finished:
                self._want = index
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="monarch-kernel-backward", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                self._cond.wait_for(lambda: index in self._got or self._finished)
                self._want = None
            if index in self._got:
                return self._got.pop(index)
            if self._error is not None:
                raise self._error
            return torch.zeros_like(self.wrt[index])

    def _run(self) -> None:
        hooks = []
        try:
            for i in self._needed:
                hooks.append(self.wrt[i].register_hook(lambda g, i=i: self._hook(i, g)))
            inputs = [self.wrt[i] for i in self._needed]
            grads = torch.autograd.grad(self.roots, inputs, self.grad_roots, allow_unused=True) if inputs else ()
            with self._cond:
                for i, g in zip(self._needed, grads, strict=True):
                    if i not in self._made and g is not None:
                        self._got[i] = g
                        self._made.add(i)
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001  (handed to whoever asks for a gradient)
            self._error = e
        finally:
            for h in hooks:
                h.remove()
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _hook(self, index: int, grad: torch.Tensor) -> None:
        with self._cond:
            if self._stopped:
                raise _Stopped
            if index not in self._made:
                self._got[index] = grad
                self._made.add(index)
                self._cond.notify_all()
            if len(self._made) == len(self._needed):  # the last one: let the pass end
                return
            self._cond.wait_for(lambda: self._stopped or (self._want is not None and self._want not in self._got))
            if self._stopped:
                raise _Stopped

    def stop(self) -> None:
        """Stop a pass that was not run to its end (its session was deleted)."""
        with self._cond:
            self._stopped = True
            self._got.clear()
            self._cond.notify_all()


class _Custom(torch.autograd.Function):
    """The autograd node of a ``grad_function``: its forward's result, and the backward it
    returned, called with the gradients of the result."""

    @staticmethod
    def forward(ctx, fn, *args):
        result, backward = fn(*args)
        ctx.continuation = backward
        return result

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.continuation(*grads)
        ctx.continuation = None  # the closure (and the tensors it holds) goes once used
        return (None, *(got if isinstance(got, tuple) else (got,)))


def custom_grad(fn, *args, **kwargs):
    """``grad_function``'s call: ``fn(*args, **kwargs)`` returns ``(result, backward)``."""
    return _Custom.apply(functools.partial(fn, **kwargs) if kwargs else fn, *args)
