"""Monarch's ``monarch.rdma`` API on real ranks, over shm and tcp: every public name imports,
``size()``, an awaitable ``drop()``, reads into larger memory, the backend reported, and
``RDMAAction`` (checked as ops are added, run concurrently, reusable across submits)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import time
import zlib

import numpy as np
import pytest
import torch
from support.freeze import freeze, thaw

import monarch_kernel.rdma
from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.data import BufferDropped, ibverbs
from monarch_kernel.rdma import (
    RDMAAction,
    RDMABuffer,
    RDMAReadTransferWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
    get_rdma_backend,
    is_ibverbs_available,
)

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20
FILL = 0xAB  # what a destination holds before a read; bytes the read must not touch keep it

# python/monarch/rdma/__init__.py in meta-pytorch/monarch: its __all__.
MONARCH_RDMA_ALL = ["get_rdma_backend", "is_ibverbs_available", "RDMABuffer", "RDMAAction",
                    "RDMAReadTransferWarning", "RDMATcpFallbackWarning", "RDMAWriteTransferWarning"]


def pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def crc(t) -> int:
    return zlib.crc32(memoryview(t.numpy() if isinstance(t, torch.Tensor) else t).cast("B"))


def filled(n: int) -> torch.Tensor:
    return torch.full((n,), FILL, dtype=torch.uint8)


class Owner(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def make(self, names: list, n: int, seed: int = 0) -> list:
        """One buffer per name, ``n`` bytes each of a seeded pattern: [(buffer, crc)]."""
        out = []
        for i, name in enumerate(names):
            self.kept[name] = pattern(n, seed + i)
            out.append((RDMABuffer(self.kept[name], name=name), crc(self.kept[name])))
        return out

    @endpoint
    def filled_with(self, name: str, n: int, value: float) -> RDMABuffer:
        """A buffer over ``n`` float32s, each ``value``."""
        self.kept[name] = torch.full((n,), value, dtype=torch.float32)
        return RDMABuffer(self.kept[name].view(torch.uint8), name=name)

    @endpoint
    def values(self, name: str) -> list:
        return self.kept[name].unique().tolist()

    @endpoint
    def crcs(self, names: list) -> list:
        return [crc(self.kept[name]) for name in names]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def drop_here(self, buf: RDMABuffer) -> str:
        """In the owner's own process drop() is done at once, and awaitable."""
        fut = buf.drop()
        done = fut.done()
        await fut
        return f"done={done}"


class Peer(Actor):
    """A reader rank: everything here runs in another process than the buffers' owner."""

    @endpoint
    def size_of(self, buf: RDMABuffer) -> tuple:
        dst = torch.empty(buf.size(), dtype=torch.uint8)  # Monarch's spelling sizes real memory
        moved = buf.read_into(dst).get(timeout=30)
        return (buf.size(), type(buf.size()).__name__, buf.size == buf.size(), moved,
                type(pickle.loads(pickle.dumps(buf.size))).__name__, buf.size // 2, crc(dst))

    @endpoint
    def read_larger(self, buf: RDMABuffer, extra: int, offset: int = 0) -> tuple:
        """Read into memory ``extra`` bytes larger than what the buffer holds from ``offset``."""
        dst = filled(buf.size - offset + extra)
        moved = buf.read_into(dst, offset).get(timeout=30)
        head = dst[:buf.size - offset]
        return moved, crc(head), bool((dst[buf.size - offset:] == FILL).all())

    @endpoint
    def write_too_much(self, buf: RDMABuffer) -> tuple:
        try:
            buf.write_from(torch.zeros(buf.size + 1, dtype=torch.uint8))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return type(e).__name__, str(e)
        return "ok", ""

    @endpoint
    def try_read(self, buf: RDMABuffer) -> str:
        try:
            buf.read_into(torch.empty(buf.size, dtype=torch.uint8)).get(timeout=30)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return type(e).__name__
        return "ok"

    @endpoint
    async def drop_started(self, buf: RDMABuffer) -> bool:
        """Begin a drop in this loop and keep its Future; whether it returned still pending."""
        self.dropping = (buf, buf.drop())
        return not self.dropping[1].done()

    @endpoint
    async def drop_awaited(self) -> str:
        """Await the drop begun, then try to read the buffer."""
        buf, fut = self.dropping
        await fut
        try:
            await buf.read_into(torch.empty(buf.size, dtype=torch.uint8))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return type(e).__name__
        return "ok"

    @endpoint
    async def drop_unawaited(self, buf: RDMABuffer) -> None:
        buf.drop()  # never awaited: the drop still reaches the owner

    @endpoint
    async def read_then_write_awaited_in_reverse(self, buf: RDMABuffer) -> tuple:
        """Monarch's test_rdma_concurrent_2gb_writes_in_order, small: a read issued, then a
        write; the write awaited first.  A third transfer, never awaited, never runs."""
        n = buf.size() // 4
        a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.full((n,), 3.0)
        future_a = buf.read_into(a.view(torch.uint8))
        future_b = buf.write_from(b.view(torch.uint8))
        buf.write_from(c.view(torch.uint8))  # never awaited nor read: never started
        await future_b
        await future_a
        return a.unique().tolist(), b.unique().tolist()

    @endpoint
    def read_then_write_got_in_reverse(self, buf: RDMABuffer) -> list:
        """The same from synchronous code: ``.get()`` starts a transfer as ``await`` does."""
        n = buf.size() // 4
        a = torch.ones(n)
        future_a = buf.read_into(a.view(torch.uint8))
        buf.write_from(torch.full((n,), 4.0).view(torch.uint8)).get(timeout=30)
        future_a.get(timeout=30)
        return a.unique().tolist()

    @endpoint
    async def submit_awaited_later(self, buf: RDMABuffer) -> tuple:
        """An RDMAAction's submit runs when its Future is awaited, too: a read awaited first
        sees the buffer as it was."""
        n = buf.size() // 4
        a, before = torch.zeros(n), torch.zeros(n)
        submitted = RDMAAction().write_remote(buf, torch.full((n,), 5.0).view(torch.uint8)).submit()
        await buf.read_into(before.view(torch.uint8))
        await submitted
        await buf.read_into(a.view(torch.uint8))
        return before.unique().tolist(), a.unique().tolist()

    @endpoint
    def backend(self, buf: RDMABuffer | None = None) -> tuple:
        return is_ibverbs_available(), get_rdma_backend(), None if buf is None else buf.backend

    @endpoint
    async def read_all(self, bufs: list, extra: int = 0) -> list:
        """One action reads every buffer into its own (possibly larger) slot."""
        slots = [filled(b.size() + extra) for b in bufs]
        action = RDMAAction()
        for slot, b in zip(slots, bufs, strict=True):
            assert action.read_remote(slot, b) is action
        assert await action.submit(timeout=60) is None
        return [(crc(s[:b.size]), bool((s[b.size:] == FILL).all())) for s, b in zip(slots, bufs, strict=True)]

    @endpoint
    def write_all(self, bufs: list, seed: int) -> list:
        srcs = [pattern(b.size, seed + i) for i, b in enumerate(bufs)]
        action = RDMAAction()
        for b, src in zip(bufs, srcs, strict=True):
            action.write_remote(b, src)
        action.submit().get(timeout=60)
        return [crc(s) for s in srcs]

    @endpoint
    def mixed_twice(self, reads: list, writes: list, seed: int) -> tuple:
        """Reads and writes in one action, submitted twice (the slots zeroed in between)."""
        slots = [torch.zeros(b.size, dtype=torch.uint8) for b in reads]
        srcs = [pattern(b.size, seed + i) for i, b in enumerate(writes)]
        action = RDMAAction()
        for slot, b in zip(slots, reads, strict=True):
            action.read_remote(slot, b)
        for b, src in zip(writes, srcs, strict=True):
            action.write_remote(b, src)
        assert len(action) == len(reads) + len(writes)
        action.submit().get(timeout=60)
        first = [crc(s) for s in slots]
        for s in slots:
            s.zero_()
        action.submit().get(timeout=60)
        return first, [crc(s) for s in slots], [crc(s) for s in srcs]

    @endpoint
    async def submit_while_in_flight(self, bufs: list) -> tuple:
        """Two submits awaited at once run one after the other; adding ops meanwhile is refused."""
        slots = [torch.zeros(b.size, dtype=torch.uint8) for b in bufs]
        action = RDMAAction()
        for slot, b in zip(slots, bufs, strict=True):
            action.read_remote(slot, b)
        first, second = action.submit(), action.submit()
        both = asyncio.gather(first, second)
        await asyncio.sleep(0)  # both tasks take their first step: the submits start
        refused = ""
        if not second.done():
            try:
                action.read_remote(torch.zeros(bufs[0].size, dtype=torch.uint8), bufs[0])
            except RuntimeError as e:
                refused = str(e)
        await both
        action.read_remote(torch.zeros(bufs[0].size, dtype=torch.uint8), bufs[0])  # allowed again
        return refused, [crc(s) for s in slots]

    @endpoint
    def submit_reads(self, bufs: list) -> list:
        slots = [torch.zeros(b.size, dtype=torch.uint8) for b in bufs]
        action = RDMAAction()
        for slot, b in zip(slots, bufs, strict=True):
            action.read_remote(slot, b)
        action.submit().get(timeout=90)
        return [crc(s) for s in slots]

    @endpoint
    def submit_with_failures(self, good: list, dropped: list) -> tuple:
        slots = [filled(b.size) for b in good + dropped]
        action = RDMAAction()
        for slot, b in zip(slots, good + dropped, strict=True):
            action.read_remote(slot, b)
        try:
            action.submit().get(timeout=60)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            kind, notes = type(e).__name__, getattr(e, "__notes__", [])
        else:
            kind, notes = "ok", []
        return kind, notes, [crc(s) for s in slots[:len(good)]]


class Probe(Actor):
    """Beside the Peer in its process: counts that process's transfers in progress."""

    @endpoint
    def transfers_in_progress(self) -> int:
        from monarch_kernel.data import transfer

        n = 0
        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code.co_filename == transfer.__file__ and frame.f_code.co_name == "transfer":
                    n += 1
                    break
                frame = frame.f_back
        return n


def _wait(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def ranks(request):
    """An owner rank and a peer rank (with a probe beside it), told to use one transport."""
    env = {"MONARCH_KERNEL_DATA_TRANSPORT": request.param}
    with this_host().spawn_procs(per_host={"ranks": 2}, env=env) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        peer = procs.slice(ranks=1).spawn("peer", Peer)
        probe = procs.slice(ranks=1).spawn("probe", Probe)
        yield request.param, owner, peer, probe


def _make(owner, tag: str, k: int, n: int, seed: int) -> tuple[list, list]:
    made = owner.make.call_one([f"{tag}{i}" for i in range(k)], n, seed).get(timeout=60)
    return [b for b, _ in made], [c for _, c in made]


# ---------------------------------------------------------------- names


def test_every_name_of_monarch_rdma_imports_from_monarch_kernel_rdma():
    assert monarch_kernel.rdma.__all__[:len(MONARCH_RDMA_ALL)] == MONARCH_RDMA_ALL
    for name in MONARCH_RDMA_ALL:
        assert getattr(monarch_kernel.rdma, name) is not None, name
    for w in (RDMAReadTransferWarning, RDMATcpFallbackWarning, RDMAWriteTransferWarning):
        assert issubclass(w, Warning)
    assert callable(RDMABuffer.drop) and isinstance(RDMAAction(), RDMAAction)


# ---------------------------------------------------------------- RDMABuffer


def test_size_is_a_method_and_still_a_number(ranks):
    _transport, owner, peer, _probe = ranks
    [buf], [expect] = _make(owner, "sized", 1, 3 * KiB + 5, seed=1)
    assert buf.size() == buf.size == 3 * KiB + 5 and type(buf.size()) is int
    assert peer.size_of.call_one(buf).get(timeout=30) == (
        3 * KiB + 5, "int", True, 3 * KiB + 5, "int", (3 * KiB + 5) // 2, expect)


@pytest.mark.parametrize("offset", [0, 1000])
def test_read_into_larger_memory_reads_what_the_buffer_holds(ranks, offset):
    _transport, owner, peer, _probe = ranks
    [buf], _ = _make(owner, f"larger{offset}", 1, 64 * KiB + 3, seed=2)
    want = crc(pattern(64 * KiB + 3, 2)[offset:])
    assert peer.read_larger.call_one(buf, 4097, offset).get(timeout=30) == (64 * KiB + 3 - offset, want, True)
    # And in the owner's own process (a local copy).
    mine = RDMABuffer(pattern(100, 3), name="mine")
    dst = filled(164)
    assert mine.read_into(dst).get(timeout=5) == 100
    assert crc(dst[:100]) == crc(pattern(100, 3)) and bool((dst[100:] == FILL).all())
    mine.drop()


def test_write_from_larger_memory_is_refused_before_anything_moves(ranks):
    _transport, owner, peer, _probe = ranks
    [buf], [expect] = _make(owner, "full", 1, 4 * KiB, seed=4)
    kind, msg = peer.write_too_much.call_one(buf).get(timeout=30)
    assert kind == "ValueError", (kind, msg)
    assert msg.startswith("cannot write 4097 bytes at offset 0 of buffer 'full0', which holds 4096 bytes"), msg
    assert owner.crcs.call_one(["full0"]).get(timeout=30) == [expect]


def test_drop_is_awaitable_and_happens_without_await(ranks):
    _transport, owner, peer, _probe = ranks
    bufs, _ = _make(owner, "drop", 4, KiB, seed=5)
    # Inside an async endpoint: drop() returns at once with the owner's answer still to come
    # (the owner is frozen, so it surely is); awaited, it ends with that answer once the owner
    # goes on, and the buffer is refused afterwards.
    pid = owner.pid.call_one().get(timeout=10)
    freeze(pid)
    try:
        assert peer.drop_started.call_one(bufs[0]).get(timeout=30) is True
        awaited = peer.drop_awaited.call_one()
    finally:
        thaw(pid)
    assert awaited.get(timeout=30) == "BufferDropped"
    # Never awaited, in an async endpoint: the owner still drops it.
    peer.drop_unawaited.call_one(bufs[1]).get(timeout=30)
    _wait("the unawaited drop to reach the owner",
          lambda: peer.try_read.call_one(bufs[1]).get(timeout=30) == "BufferDropped", 10)
    # Synchronous code (here, the controller): done when drop() returns; the Future is done.
    fut = bufs[2].drop()
    assert fut.done() and fut.get(timeout=1) is None
    assert peer.try_read.call_one(bufs[2]).get(timeout=30) == "BufferDropped"
    # In the owner's process, inside an async endpoint.
    assert owner.drop_here.call_one(bufs[3]).get(timeout=30) == "done=True"
    assert peer.try_read.call_one(bufs[3]).get(timeout=30) == "BufferDropped"
    with pytest.raises(BufferDropped, match="'drop3' was dropped"):
        asyncio.run(_read(bufs[3]))


async def _read(buf: RDMABuffer) -> None:
    await buf.read_into(torch.empty(buf.size, dtype=torch.uint8))


def test_transfers_start_when_awaited_or_read_in_that_order(ranks):
    """As in Monarch (its test_rdma_concurrent_2gb_writes_in_order): a read issued before a
    write, but awaited after it, sees the written data.  Before, each started when issued:
    the read got the 0.0s from before the write."""
    _transport, owner, peer, _probe = ranks
    buf = owner.filled_with.call_one("lazy", 256 * KiB, 0.0).get(timeout=30)
    assert peer.read_then_write_awaited_in_reverse.call_one(buf).get(timeout=60) == ([2.0], [2.0])
    assert owner.values.call_one("lazy").get(timeout=30) == [2.0]  # the unawaited write of 3.0s never ran
    assert peer.read_then_write_got_in_reverse.call_one(buf).get(timeout=60) == [4.0]
    assert peer.submit_awaited_later.call_one(buf).get(timeout=60) == ([4.0], [5.0])
    assert owner.values.call_one("lazy").get(timeout=30) == [5.0]


def test_backend_names_what_transfers_use(ranks):
    transport, owner, peer, _probe = ranks
    [buf], _ = _make(owner, "backend", 1, 16, seed=6)
    nic = ibverbs.is_available()[0]
    # Without a NIC Monarch says "tcp" for its NIC-free fallback: here shm and tcp.
    assert is_ibverbs_available() is nic and get_rdma_backend() == ("ibverbs" if nic else "tcp")
    assert peer.backend.call_one(buf).get(timeout=30) == (nic, "tcp", "tcp")  # shm or tcp forced


def test_backend_is_none_where_ibverbs_is_forced_without_a_nic():
    if ibverbs.is_available()[0]:
        pytest.skip("this host has an RDMA NIC, so forcing ibverbs works")
    env = {"MONARCH_KERNEL_DATA_TRANSPORT": "ibverbs"}
    with this_host().spawn_procs(per_host={"ranks": 1}, env=env) as procs:
        assert procs.spawn("peer", Peer).backend.call_one().get(timeout=30) == (False, "none", None)


# ---------------------------------------------------------------- RDMAAction


def test_an_action_reads_many_buffers_into_larger_slots(ranks):
    _transport, owner, peer, _probe = ranks
    bufs, expect = _make(owner, "many", 6, 256 * KiB + 7, seed=10)
    assert peer.read_all.call_one(bufs, 33).get(timeout=60) == [(c, True) for c in expect]


def test_an_action_writes_many_buffers(ranks):
    _transport, owner, peer, _probe = ranks
    bufs, _ = _make(owner, "dest", 5, 128 * KiB, seed=20)
    sent = peer.write_all.call_one(bufs, 200).get(timeout=60)
    assert owner.crcs.call_one([f"dest{i}" for i in range(5)]).get(timeout=30) == sent


def test_an_action_mixes_reads_and_writes_and_submits_again(ranks):
    _transport, owner, peer, _probe = ranks
    reads, expect = _make(owner, "src", 3, 64 * KiB, seed=30)
    writes, _ = _make(owner, "sink", 2, 32 * KiB, seed=40)
    first, second, sent = peer.mixed_twice.call_one(reads, writes, 400).get(timeout=60)
    assert first == second == expect
    assert owner.crcs.call_one(["sink0", "sink1"]).get(timeout=30) == sent
    assert owner.crcs.call_one(["src0", "src1", "src2"]).get(timeout=30) == expect  # reads left them


def test_submits_in_flight_run_in_turn_and_the_action_is_locked_meanwhile(ranks):
    _transport, owner, peer, _probe = ranks
    bufs, expect = _make(owner, "turn", 4, 4 * MiB, seed=50)
    refused, got = peer.submit_while_in_flight.call_one(bufs).get(timeout=60)
    assert got == expect
    if refused:  # the second submit was still waiting for the first
        assert refused.startswith("this RDMAAction is being submitted; await the submit in flight"), refused


def test_an_action_runs_its_ops_concurrently(ranks):
    """With the owner frozen, every op of one submit is in progress at once (one at a time
    would show one); thawed, all complete."""
    _transport, owner, peer, probe = ranks
    bufs, expect = _make(owner, "frozen", 4, MiB, seed=60)
    pid = owner.pid.call_one().get(timeout=10)
    freeze(pid)
    try:
        pending = peer.submit_reads.call_one(bufs)
        _wait("all 4 reads of the action to be in progress at once",
              lambda: probe.transfers_in_progress.call_one().get(timeout=10) == 4, 15)
        assert not pending.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert pending.get(timeout=60) == expect
    assert probe.transfers_in_progress.call_one().get(timeout=10) == 0


def test_a_failed_op_fails_the_submit_after_the_others_finish(ranks):
    _transport, owner, peer, _probe = ranks
    good, expect = _make(owner, "kept", 3, 256 * KiB, seed=70)
    gone, _ = _make(owner, "gone", 2, KiB, seed=80)
    for b in gone:
        b.drop()
    kind, notes, got = peer.submit_with_failures.call_one(good, gone).get(timeout=60)
    assert kind == "BufferDropped" and got == expect
    assert notes == ["1 more of this RDMAAction's 5 ops failed too: BufferDropped: buffer 'gone1' was dropped "
                     f"by its owner, {gone[1].owner}"], notes


def test_an_action_checks_each_op_when_it_is_added(ranks):
    """Sizes, memory kinds, argument order and overlaps raise at once, and nothing moves."""
    _transport, owner, peer, _probe = ranks
    (buf, sink), (expect, _) = _make(owner, "checked", 2, 1000, seed=90)
    a = RDMAAction()
    with pytest.raises(ValueError, match=r"destination holds 999 bytes, less than buffer 'checked0' \(1000 bytes\)"):
        a.read_remote(torch.empty(999, dtype=torch.uint8), buf)
    with pytest.raises(ValueError, match=r"source holds 1001 bytes, more than buffer 'checked0' \(1000 bytes\)"):
        a.write_remote(buf, bytearray(1001))
    with pytest.raises(ValueError, match=r"t\.contiguous\(\)"):
        a.read_remote(torch.empty(2000, dtype=torch.uint8)[::2], buf)
    with pytest.raises(TypeError, match="read-only"):
        a.read_remote(bytes(1000), buf)
    with pytest.raises(TypeError, match="dtype=object"):
        a.write_remote(buf, np.array([None] * 10, dtype=object))
    with pytest.raises(TypeError, match=r"read_remote\(dst, src\): src is the RDMABuffer and dst the local memory"):
        a.read_remote(buf, torch.empty(1000, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dst must be an RDMABuffer, not torch.Tensor"):
        a.write_remote(torch.empty(10), torch.empty(10))
    with pytest.raises(NotImplementedError, match="fetch_add is not supported"):
        a.fetch_add(buf, torch.empty(1, dtype=torch.int64), 1)
    assert len(a) == 0

    # A read writes its destination: it may share local memory with no other op.
    mem = torch.zeros(4000, dtype=torch.uint8)
    a.read_remote(mem[:1000], buf).read_remote(mem[1000:2000], buf)  # adjacent: fine
    with pytest.raises(ValueError, match=r"read_remote's destination overlaps the destination of a read_remote "
                                         r"already in this RDMAAction \(bytes 0\.\.500 of it\)"):
        a.read_remote(mem[1500:2500], buf)
    with pytest.raises(ValueError, match="write_remote's source overlaps the destination of a read_remote"):
        a.write_remote(sink, mem[1999:2100])
    # Writes only read their source: several may share it, but no read may land there.  (They
    # go to another buffer than the reads come from: remote ranges are not checked.)
    a.write_remote(sink, mem[3000:4000]).write_remote(sink, mem[3000:3500])
    with pytest.raises(ValueError, match="read_remote's destination overlaps the source of a write_remote"):
        a.read_remote(mem[2900:3900], buf)
    assert len(a) == 4 and repr(a) == "RDMAAction<2 reads, 2 writes>"
    # Dtypes are not compared (buffers are bytes, as in Monarch): 250 float32s hold 1000 bytes.
    floats = torch.zeros(250, dtype=torch.float32)
    RDMAAction().read_remote(floats, buf).submit().get(timeout=30)
    assert crc(floats.view(torch.uint8)) == expect
    # Nothing moved while the ops were added; the refused ones never run.
    assert int(mem.sum()) == 0
    assert owner.crcs.call_one(["checked1"]).get(timeout=30) == [crc(pattern(1000, 91))]
    a.submit().get(timeout=30)
    assert crc(mem[:1000]) == crc(mem[1000:2000]) == expect
    assert owner.crcs.call_one(["checked0", "checked1"]).get(timeout=30) == [expect, zlib.crc32(bytes(1000))]


def test_an_empty_action_and_monarchs_earlier_spellings():
    assert RDMAAction().submit().get(timeout=5) is None
    buf = RDMABuffer(pattern(64, 7), name="here")
    dst, src = torch.zeros(64, dtype=torch.uint8), pattern(64, 8)
    a = RDMAAction().read_into(buf, dst)  # earlier Monarch: read_into(src_buffer, dst_memory)
    asyncio.run(_submit(a))
    assert torch.equal(dst, pattern(64, 7))
    RDMAAction().write_from(buf, src).submit().get(timeout=5)  # earlier: write_from(buffer, local)
    buf.read_into(dst).get(timeout=5)
    assert torch.equal(dst, src)
    buf.drop()


async def _submit(action: RDMAAction) -> None:
    await action.submit(timeout=10)


def test_read_into_larger_gpu_memory_and_a_gpu_action():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: GPU destinations need one")
    with this_host().spawn_procs(per_host={"ranks": 2}) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        gpu = procs.slice(ranks=1).spawn("gpu", GpuPeer)
        bufs, expect = _make(owner, "togpu", 3, MiB + 1, seed=100)
        assert gpu.read_larger.call_one(bufs[0], 4096).get(timeout=60) == (MiB + 1, expect[0], True)
        assert gpu.read_all.call_one(bufs).get(timeout=60) == expect


class GpuPeer(Actor):
    @endpoint
    def read_larger(self, buf: RDMABuffer, extra: int) -> tuple:
        dst = torch.full((buf.size + extra,), FILL, dtype=torch.uint8, device="cuda")
        moved = buf.read_into(dst).get(timeout=60)
        host = dst.cpu()
        return moved, crc(host[:buf.size]), bool((host[buf.size:] == FILL).all())

    @endpoint
    def read_all(self, bufs: list) -> list:
        slots = torch.zeros(sum(b.size for b in bufs), dtype=torch.uint8, device="cuda")
        action, at = RDMAAction(), 0
        for b in bufs:
            action.read_remote(slots[at:at + b.size], b)
            at += b.size
        action.submit().get(timeout=60)
        host, at, out = slots.cpu(), 0, []
        for b in bufs:
            out.append(crc(host[at:at + b.size]))
            at += b.size
        return out
