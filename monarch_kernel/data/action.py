"""``RDMAAction``: Monarch's batch of reads and writes over many ``RDMABuffer``s, checked as
each op is added and run all at once by every ``submit()`` once its Future is awaited or
read.  It must never start a transfer before then, nor let two ops of one batch race on the
same local memory.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from ..actor.future import Future
from ..runtime import Completion
from . import wire
from .buffer import RDMABuffer
from .memory import Memory, as_memory, describe, prefix, span

# Validation follows Monarch's: byte sizes (a read's destination holds at least the whole
# buffer, a write's source fits in it), layout (contiguous, a known kind of memory) and the
# local memory the ops touch: a read writes its destination, so it may overlap no other op's
# local memory; writes only read theirs, so several may share a source.  Remote ranges are
# not tracked (two writes to one buffer race, as in Monarch).  Dtypes are not compared:
# buffers are bytes, and Monarch reads a float32 buffer into any tensor of as many bytes.
#
# A submit's Future, once awaited or read, starts every op at once (each remote one on its
# own pooled connection) and resolves when all have finished, with the first failure (in
# the order the ops were added) if any failed.  A submit started while another is in flight
# runs when that one ends, so the overlap checks stay true across submits, and adding ops
# meanwhile is refused.


@dataclass(frozen=True)
class _Op:
    op: wire.Op
    buf: RDMABuffer
    mem: Memory


class RDMAAction:
    """Reads and writes over many buffers, submitted together and run concurrently.

    Each op is checked when it is added (``ValueError`` for sizes and overlaps, ``TypeError``
    for memory that cannot take part); ``submit()`` may be called any number of times and
    runs the same ops again.

    Example::

        action = RDMAAction()
        for buf, slot in zip(buffers, slots):
            action.read_remote(slot, buf)      # slot <- buf
        action.write_remote(results, local)    # results <- local
        await action.submit(timeout=60)
        action.submit().get()                  # the same transfers once more
    """

    def __init__(self) -> None:
        self._ops: list[_Op] = []
        self._claims: list[tuple[str, int, int, bool]] = []  # (device, start, end, writes it)
        self._lock = threading.Lock()
        self._last: Completion | None = None  # the latest submit's, while it may be running

    def __len__(self) -> int:
        return len(self._ops)

    def __repr__(self) -> str:
        reads = sum(o.op == wire.Op.READ for o in self._ops)
        return f"RDMAAction<{reads} reads, {len(self._ops) - reads} writes>"

    # ------------------------------------------------------------ adding ops

    def read_remote(self, dst, src: RDMABuffer) -> RDMAAction:
        """Queue a read of all of buffer ``src`` into local memory ``dst`` (at least as large;
        the rest of a larger ``dst`` is left as it is)."""
        _order("read_remote(dst, src)", "src", src, "dst", dst)
        mem = as_memory(dst, writable=True, what="read_remote's destination")
        if mem.readonly:
            raise TypeError("read_remote's destination is read-only; pass a writable tensor, array or bytearray")
        if mem.nbytes < src.size:
            raise ValueError(f"read_remote's destination holds {mem.nbytes} bytes, less than buffer "
                             f"{src.name!r} ({src.size} bytes): pass memory of at least {src.size} bytes, "
                             "or use buf.read_into(dst) to read only the first part")
        return self._add(wire.Op.READ, src, prefix(mem, src.size))

    def write_remote(self, dst: RDMABuffer, src) -> RDMAAction:
        """Queue a write of all of local memory ``src`` into the start of buffer ``dst``."""
        _order("write_remote(dst, src)", "dst", dst, "src", src)
        mem = as_memory(src, writable=False, what="write_remote's source")
        if mem.nbytes > dst.size:
            raise ValueError(f"write_remote's source holds {mem.nbytes} bytes, more than buffer {dst.name!r} "
                             f"({dst.size} bytes): pass at most {dst.size} bytes")
        return self._add(wire.Op.WRITE, dst, mem)

    def read_into(self, src: RDMABuffer, dst) -> RDMAAction:
        """Earlier Monarch releases' spelling of ``read_remote(dst, src)``."""
        return self.read_remote(dst, src)

    def write_from(self, src: RDMABuffer, dst) -> RDMAAction:
        """Earlier Monarch releases' spelling of ``write_remote(src, dst)``: ``src`` is the
        buffer written, ``dst`` the local memory written from (Monarch's names)."""
        return self.write_remote(src, dst)

    def fetch_add(self, src: RDMABuffer, dst, add: int) -> RDMAAction:
        raise NotImplementedError("RDMAAction.fetch_add is not supported, as in Monarch; read the value, "
                                  "change it, and write it back from one actor instead")

    def compare_and_swap(self, src: RDMABuffer, dst, compare: int, swap: int) -> RDMAAction:
        raise NotImplementedError("RDMAAction.compare_and_swap is not supported, as in Monarch; let one "
                                  "actor own the value and change it through an endpoint instead")

    def _add(self, op: wire.Op, buf: RDMABuffer, mem: Memory) -> RDMAAction:
        buf._check(op, mem.nbytes, 0)
        device, start, end = span(mem)
        writes = op == wire.Op.READ  # a read writes local memory
        with self._lock:
            if self._last is not None and not self._last.done():
                raise RuntimeError("this RDMAAction is being submitted; await the submit in flight "
                                   "before adding to it, or build another RDMAAction")
            for d, s, e, w in self._claims:
                if d == device and start < e and s < end and (writes or w):
                    mine = "read_remote's destination" if writes else "write_remote's source"
                    theirs = "the destination of a read_remote" if w else "the source of a write_remote"
                    raise ValueError(f"{mine} overlaps {theirs} already in this RDMAAction (bytes "
                                     f"{max(s, start) - start}..{min(e, end) - start} of it): the two would race; "
                                     "use separate memory, or submit them in separate actions")
            self._claims.append((device, start, end, writes))
            self._ops.append(_Op(op, buf, mem))
        return self

    # ------------------------------------------------------------ running

    def submit(self, *, timeout: float | None = None) -> Future[None]:
        """Run every op queued now, all at once, when the Future is first awaited or read
        (as Monarch's submit); it resolves when all are done, or raises the first failure
        once all have ended.  ``timeout``: seconds an owner may go without progress (None:
        as long as it lives; a dead owner is an error at once)."""
        done = Completion()
        with self._lock:
            ops = list(self._ops)

        def start() -> None:
            with self._lock:
                before, self._last = self._last, done
            if before is None or before.done():
                _run(ops, timeout, done)
            else:
                before.add_done_callback(lambda _c: _run(ops, timeout, done))

        return Future(done, start=start)


def _run(ops: list[_Op], timeout: float | None, done: Completion) -> None:
    """Start ``ops`` and settle ``done`` once every one has ended."""
    if not ops:
        done.set_result(None)
        return
    errors: list[BaseException | None] = [None] * len(ops)
    left = [len(ops)]
    lock = threading.Lock()

    def ended(i: int, error: BaseException | None) -> None:
        with lock:
            errors[i] = error
            left[0] -= 1
            if left[0]:
                return
        failed = [e for e in errors if e is not None]
        if not failed:
            done.set_result(None)
            return
        if len(failed) > 1 and sys.version_info >= (3, 11):
            failed[0].add_note(f"{len(failed) - 1} more of this RDMAAction's {len(ops)} ops failed too: "
                               + "; ".join(f"{type(e).__name__}: {e}" for e in failed[1:]))
        done.set_exception(failed[0])

    def watch(i: int, fut: Future[int]) -> None:
        fut.then(lambda f: ended(i, f.exception()))

    for i, o in enumerate(ops):
        try:
            watch(i, o.buf._launch(o.op, o.mem, 0, timeout))
        except BaseException as e:  # noqa: BLE001 - delivered through the submit's Future
            ended(i, e)


def _order(call: str, buf_name: str, buf, mem_name: str, mem) -> None:
    """Refuse arguments given the wrong way round, saying which goes where."""
    if isinstance(buf, RDMABuffer):
        return
    if isinstance(mem, RDMABuffer):
        raise TypeError(f"{call}: {buf_name} is the RDMABuffer and {mem_name} the local memory; "
                        "they were passed the other way round")
    raise TypeError(f"{call}: {buf_name} must be an RDMABuffer, not {describe(buf)}")
