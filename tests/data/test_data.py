"""RDMABuffer between real rank processes: bytes arrive intact over every transport usable
here, sizes and handles are checked, and an owner's drop or death is an error, never a hang."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, replace

import numpy as np
import pytest
import torch
from support.buffers import MiB, crc, pattern
from support.config import configured
from support.freeze import freeze

from monarch_kernel import Actor, RDMABuffer, endpoint, this_host
from monarch_kernel.data import BufferDropped, ForgedHandle, OwnerGone, TransferError, transports, wire
from monarch_kernel.data.buffer import _rebuild
from monarch_kernel.data.order import IssueOrder
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(120)

class Owner(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def make(self, name: str, n: int, seed: int = 0) -> tuple:
        t = pattern(n, seed)
        self.kept[name] = t
        return RDMABuffer(t, name=name), crc(t)

    @endpoint
    def share(self, name: str, obj) -> RDMABuffer:
        self.kept[name] = obj
        return RDMABuffer(obj, name=name)

    @endpoint
    def make_gpu(self, n: int) -> RDMABuffer:
        self.kept["gpu"] = torch.arange(n, dtype=torch.float32, device="cuda")
        return RDMABuffer(self.kept["gpu"], name="gpu")

    @endpoint
    def get(self, name: str):
        return self.kept[name]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop()


class Reader(Actor):
    @endpoint
    def read_crc(self, buf: RDMABuffer, n: int | None = None, offset: int = 0) -> tuple:
        dst = torch.empty(buf.size - offset if n is None else n, dtype=torch.uint8)
        buf.read_into(dst, offset).get(timeout=60)
        return buf.transport(), crc(dst)

    @endpoint
    def read_gpu(self, buf: RDMABuffer) -> tuple:
        dst = torch.empty(buf.size // 4, dtype=torch.float32, device="cuda")
        buf.read_into(dst).get(timeout=60)
        return buf.transport("cuda"), dst.cpu()

    @endpoint
    def read_like(self, buf: RDMABuffer, like):
        dst = torch.empty_like(like) if isinstance(like, torch.Tensor) else np.empty_like(like)
        buf.read_into(dst).get(timeout=30)
        return dst

    @endpoint
    def path_kind(self, buf: RDMABuffer) -> str:
        """How this rank reached the owner's memory last time (shm: mapped or cross-memory)."""
        from monarch_kernel.data import shm

        return shm.reached_by(buf._h)

    @endpoint
    def write(self, buf: RDMABuffer, src, offset: int = 0) -> int:
        return buf.write_from(src, offset).get(timeout=60)

    @endpoint
    async def writes_then_read(self, buf: RDMABuffer, n: int, values: list) -> list:
        """One write of ``n`` bytes per value and then a read, awaited together (each starts
        when awaited, so all are started before any ends); the read's distinct bytes."""
        import asyncio

        futs = [buf.write_from(torch.full((n,), v, dtype=torch.uint8)) for v in values]
        dst = torch.empty(n, dtype=torch.uint8)
        futs.append(buf.read_into(dst))
        await asyncio.gather(*futs)
        return dst.unique().tolist()

    @endpoint
    def concurrent(self, buf: RDMABuffer, k: int) -> list:
        dsts = [torch.empty(buf.size, dtype=torch.uint8) for _ in range(k)]
        futs = [buf.read_into(d) for d in dsts]
        for f in futs:
            f.get(timeout=60)
        return [crc(d) for d in dsts]

    @endpoint
    async def read_many_async(self, bufs: list) -> list:
        """Await several reads at once from an async endpoint (the IO loop must stay free)."""
        import asyncio

        dsts = [torch.empty(b.size, dtype=torch.uint8) for b in bufs]
        await asyncio.gather(*(b.read_into(d) for b, d in zip(bufs, dsts, strict=True)))
        return [crc(d) for d in dsts]

    @endpoint
    def try_read(self, buf: RDMABuffer, timeout: float = 30) -> tuple:
        t0 = time.monotonic()
        try:
            buf.read_into(torch.empty(buf.size, dtype=torch.uint8)).get(timeout=timeout)
            return "ok", "", time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return type(e).__name__, str(e), time.monotonic() - t0


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pair(request):
    """An owner rank and two reader ranks, all told to use one transport (tcp: split over
    three connections, so transfers also cross stream boundaries)."""
    env = {"MONARCH_KERNEL_DATA_TRANSPORT": request.param, "MONARCH_KERNEL_TCP_STREAMS": "3"}
    with this_host().spawn_procs(per_host={"ranks": 3}, env=env) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        readers = procs.slice(ranks=slice(1, 3)).spawn("readers", Reader)
        yield request.param, owner, readers


@pytest.mark.parametrize("n", [0, 1, 4093, 64 * MiB, 512 * MiB], ids=["0", "1", "4093", "64MiB", "512MiB"])
def test_read_checksums(pair, n):
    transport, owner, readers = pair
    buf, expect = owner.make.call_one(f"b{n}", n, seed=n).get(timeout=60)
    assert buf.size == n
    got = readers.read_crc.call(buf).get(timeout=90)
    assert list(got.values()) == [(transport, expect)] * 2
    owner.drop.call_one(buf).get(timeout=10)


def test_write_from_with_offset_reaches_every_view_of_the_owners_tensor(pair):
    transport, owner, readers = pair
    base = torch.zeros(8 * MiB, dtype=torch.uint8)
    buf = owner.share.call_one("w", base).get(timeout=30)
    src = pattern(MiB, seed=7)
    assert readers.slice(ranks=0).write.call_one(buf, src, 3 * MiB).get(timeout=60) == MiB
    back = owner.get.call_one("w").get(timeout=30)
    assert torch.equal(back[3 * MiB:4 * MiB], src)
    assert int(back[:3 * MiB].sum()) == 0 and int(back[4 * MiB:].sum()) == 0
    # A read at an offset sees the write.
    assert readers.slice(ranks=1).read_crc.call_one(buf, MiB, 3 * MiB).get(timeout=30) == (transport, crc(src))


def test_dtypes_arrays_and_bytearrays(pair):
    transport, owner, readers = pair
    r = readers.slice(ranks=0)
    for t in (torch.randn(1000, 3, dtype=torch.float16), torch.randn(4097).to(torch.bfloat16),
              torch.arange(-5000, 5000, dtype=torch.int64), torch.rand(999) > 0.5,
              torch.randn(513, dtype=torch.complex64), torch.tensor(3.5, dtype=torch.float64)):
        buf = owner.share.call_one(str(t.dtype), t).get(timeout=30)
        assert buf.size == t.numel() * t.element_size()
        assert torch.equal(r.read_like.call_one(buf, t).get(timeout=30), t), t.dtype
    t = torch.randn(MiB)
    buf = owner.share.call_one("tensor", t).get(timeout=30)
    assert torch.equal(r.read_like.call_one(buf, t).get(timeout=30), t)
    assert r.path_kind.call_one(buf).get(timeout=30) == ("_Mapped" if transport == "shm" else "socket")
    arr = np.linspace(0, 1, 3 * MiB // 8)
    buf = owner.share.call_one("array", arr).get(timeout=30)
    assert np.array_equal(r.read_like.call_one(buf, arr).get(timeout=30), arr)
    # An array cannot move into shared memory; on one host it is read across address spaces.
    assert r.path_kind.call_one(buf).get(timeout=30) == ("_CrossMemory" if transport == "shm" else "socket")
    ba = bytearray(os.urandom(10007))
    buf = owner.share.call_one("bytes", ba).get(timeout=30)
    assert r.read_crc.call_one(buf).get(timeout=30)[1] == zlib.crc32(ba)
    r.write.call_one(buf, b"\x00" * 7, 10000).get(timeout=30)
    assert owner.get.call_one("bytes").get(timeout=30) == ba[:10000] + b"\x00" * 7
    # Read-only memory is readable (streamed: it cannot be mapped for writing) and refuses writes.
    ro = os.urandom(3 * MiB + 5)
    buf = owner.share.call_one("readonly", ro).get(timeout=30)
    assert r.read_crc.call_one(buf).get(timeout=30)[1] == zlib.crc32(ro)
    with pytest.raises(Exception, match="registered read-only"):
        r.write.call_one(buf, b"x").get(timeout=30)


def test_concurrent_readers(pair):
    transport, owner, readers = pair
    buf, expect = owner.make.call_one("shared", 16 * MiB, seed=3).get(timeout=30)
    got = readers.concurrent.call(buf, 4).get(timeout=90)
    assert list(got.values()) == [[expect] * 4] * 2
    made = [owner.make.call_one(f"a{i}", (i + 1) * MiB, seed=20 + i).get(timeout=30) for i in range(3)]
    got = readers.read_many_async.call([b for b, _ in made]).get(timeout=90)
    assert list(got.values()) == [[c for _, c in made]] * 2


@pytest.mark.parametrize("n,values,rounds", [(64 << 10, list(range(1, 17)), 6), (9 * MiB, [0, 2], 2)],
                         ids=["16x64KiB", "zeros-then-twos-9MiB"])
def test_writes_one_caller_starts_land_in_the_order_it_started_them(pair, n, values, rounds):
    """Transfers started back to back (awaited together), before any had ended, ran at once
    on separate worker threads and connections, and the owner applied them interleaved (the buffer kept some of
    the zeros of the first of two writes): six rounds of 16 small writes always showed it.
    9 MiB: over tcp each write is also split over three connections."""
    transport, owner, readers = pair
    full = torch.full((n,), 255, dtype=torch.uint8)
    buf = owner.share.call_one(f"order{n}", full).get(timeout=120)  # the owner may import torch here first
    for _ in range(rounds):
        # A read started after the writes sees the last of them, too.
        assert readers.slice(ranks=0).writes_then_read.call_one(buf, n, values).get(timeout=60) == [values[-1]]
        got = owner.get.call_one(f"order{n}").get(timeout=30)
        assert got.unique().tolist() == [values[-1]], {v: int((got == v).sum()) for v in got.unique().tolist()}
    owner.drop.call_one(buf).get(timeout=10)


def test_issue_order_orders_only_transfers_that_see_each_other():
    """The rule behind the test above: a transfer waits for earlier ones on overlapping bytes
    of its buffer when one of the two writes; reads of the same bytes, other bytes and other
    buffers go at once, and nothing holds a worker thread while it waits."""
    done: list[str] = []
    cond = threading.Condition()
    gate = threading.Event()

    def step(name: str, hold: threading.Event | None = None):
        def run():
            if hold is not None:
                assert hold.wait(30), "the gate was never opened"
            with cond:
                done.append(name)
                cond.notify_all()
        return run

    def until(names: set) -> None:
        with cond:
            assert cond.wait_for(lambda: names <= set(done), timeout=30), f"waited 30 s for {names}; done: {done}"

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-order") as pool:
        order = IssueOrder(pool.submit)
        order.issue("b", True, 0, 100, step("w1", gate))  # holds one of the two workers
        order.issue("b", False, 0, 10, step("r1"))
        order.issue("b", False, 5, 10, step("r2"))
        order.issue("b", True, 50, 60, step("w2"))
        order.issue("b", False, 50, 51, step("r3"))  # after w2 (and so after w1)
        order.issue("b", False, 100, 200, step("other bytes"))
        order.issue("c", True, 0, 100, step("other buffer"))
        until({"other bytes", "other buffer"})  # on the one free worker
        assert done == ["other bytes", "other buffer"] and order.running("b") == 5
        gate.set()
        until({"w1", "r1", "r2", "w2", "r3"})
    assert done.index("w1") < min(done.index("r1"), done.index("r2"), done.index("w2")) < done.index("r3")
    assert done.index("w2") < done.index("r3") and order.running("b") == 0


def test_sizes_and_layouts_are_checked():
    buf = RDMABuffer(torch.zeros(100, dtype=torch.uint8), name="small")
    with pytest.raises(ValueError, match=r"cannot read 1 bytes at offset 101 of buffer 'small', which holds 100"):
        buf.read_into(torch.empty(1, dtype=torch.uint8), offset=101)
    with pytest.raises(ValueError, match=r"cannot write 101 bytes at offset 0 of buffer 'small', which holds 100"):
        buf.write_from(torch.empty(101, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"at most 10 fit"):
        buf.write_from(bytearray(11), offset=90)
    with pytest.raises(ValueError, match=r"t\.contiguous\(\)"):
        RDMABuffer(torch.zeros(10, 10).t())
    with pytest.raises(ValueError, match="ascontiguousarray"):
        RDMABuffer(np.zeros((10, 10))[:, ::2])
    with pytest.raises(TypeError, match="read-only"):
        buf.read_into(b"x" * 10)
    with pytest.raises(TypeError, match="not str"):
        RDMABuffer("text")
    # In the owner's own process a transfer is a local copy.
    buf.write_from(bytearray(b"\x07" * 10), offset=5).get(timeout=5)
    out = bytearray(20)
    buf.read_into(out).get(timeout=5)
    assert out == b"\x00" * 5 + b"\x07" * 10 + b"\x00" * 5
    buf.drop()


def test_transports_say_why():
    listed = {t["name"]: t for t in transports()}
    assert list(listed) == ["ibverbs", "cuda_ipc", "shm", "tcp"]
    assert listed["tcp"]["available"] and listed["shm"]["available"]
    for t in listed.values():
        assert t["reason"]
    if not torch.cuda.is_available():
        assert not listed["cuda_ipc"]["available"] and "CUDA" in listed["cuda_ipc"]["reason"]
    from monarch_kernel.rdma import RDMABuffer as alias

    assert alias is RDMABuffer


def test_a_forced_transport_that_cannot_serve_is_an_error():
    with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
        owner = procs.spawn("owner", Owner)
        buf, _ = owner.make.call_one("x", 10).get(timeout=30)
        with configured(data_transport="carrier-pigeon"), \
                pytest.raises(TransferError, match="use one of ibverbs, cuda_ipc, shm, tcp"):
            buf.read_into(bytearray(10)).get(timeout=10)
        with configured(data_transport="cuda_ipc"), pytest.raises(TransferError, match="CPU memory"):
            buf.read_into(bytearray(10)).get(timeout=10)


def test_dropped_forged_and_replayed_handles_are_refused():
    key = Runtime.current().key
    with this_host().spawn_procs(per_host={"ranks": 2}) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        reader = procs.slice(ranks=1).spawn("reader", Reader)
        buf, expect = owner.make.call_one("weights", 4096).get(timeout=30)
        captured = pickle.dumps(buf)
        assert reader.read_crc.call_one(buf).get(timeout=30)[1] == expect

        # Altered fields break the signature; the reader refuses before connecting.
        h = buf._h
        bigger = _rebuild(astuple(replace(h, size=h.size * 2)))
        with pytest.raises(ForgedHandle, match="altered or forged"):
            bigger.read_into(bytearray(h.size * 2)).get(timeout=10)
        # Even signed with the job's key, a guessed token is refused by the owner.
        guessed = _rebuild(astuple(replace(h, token=b"\x00" * 16).sign(key)))
        kind, msg, _ = reader.try_read.call_one(guessed).get(timeout=30)
        assert kind == "ForgedHandle" and "wrong token for buffer 'weights'" in msg

        # A connection that cannot prove the key is closed before any request.
        with socket.create_connection((h.addresses[0], h.port), timeout=5) as s:
            with pytest.raises((wire.HandshakeFailed, ConnectionError)):
                wire.client_handshake(s, b"k" * 32)

        owner.drop.call_one(buf).get(timeout=10)
        kind, msg, _ = reader.try_read.call_one(buf).get(timeout=30)
        assert kind == "BufferDropped" and "buffer 'weights' was dropped by its owner" in msg
        replayed = pickle.loads(captured)  # the handle as it was before the drop
        with pytest.raises(BufferDropped, match="'weights' was dropped"):
            replayed.read_into(bytearray(4096)).get(timeout=10)

        # Any holder may drop a buffer, not only its owner.
        other, _ = owner.make.call_one("other", 10).get(timeout=30)
        other.drop()
        kind, msg, _ = reader.try_read.call_one(other).get(timeout=30)
        assert kind == "BufferDropped" and "'other' was dropped" in msg


class Probe(Actor):
    """Looks at its own process from beside the Reader, while the Reader's endpoint blocks."""

    @endpoint
    def waiting_on_an_owner(self) -> bool:
        """Whether a thread of this process is blocked reading an owner's answer."""
        import sys

        for frame in sys._current_frames().values():
            while frame is not None:
                code = frame.f_code
                if code.co_filename == wire.__file__ and code.co_name.startswith("recv"):
                    return True
                frame = frame.f_back
        return False


def _wait(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def _shm_entries(pids) -> set:
    """What the given processes have under /dev/shm (runtime segments, torch's files)."""
    mine = tuple(f"{prefix}{pid}{sep}" for pid in pids for prefix, sep in (("mk-", "-"), ("torch_", "_")))
    return {e for e in os.listdir("/dev/shm") if e.startswith(mine)}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_owner_death_is_an_error_within_a_second_and_leaves_no_segment(transport):
    env = {"MONARCH_KERNEL_DATA_TRANSPORT": transport}
    with this_host().spawn_procs(per_host={"ranks": 2}, env=env) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        reader = procs.slice(ranks=1).spawn("reader", Reader)
        probe = procs.slice(ranks=1).spawn("probe", Probe)
        buf, expect = owner.make.call_one("doomed", 32 * MiB).get(timeout=30)
        assert reader.read_crc.call_one(buf).get(timeout=30) == (transport, expect)
        pid = owner.pid.call_one().get(timeout=10)
        assert not _shm_entries([pid]), "registered memory must not have a name in /dev/shm"

        # A buffer this reader has not reached yet needs its owner's answer.
        fresh, _ = owner.make.call_one("doomed", MiB).get(timeout=30)

        # Pending: the owner is frozen, so the read waits; then it is killed.
        freeze(pid)
        if transport == "shm":
            # A buffer mapped before, still registered: read without its owner (liveness.py).
            assert reader.read_crc.call_one(buf).get(timeout=30) == (transport, expect)
        assert not probe.waiting_on_an_owner.call_one().get(timeout=10)
        pending = reader.try_read.call_one(fresh)
        _wait("the read to wait on the frozen owner's answer",
              lambda: probe.waiting_on_an_owner.call_one().get(timeout=10), 10)
        os.kill(pid, signal.SIGKILL)
        kind, msg, _ = pending.get(timeout=30)
        assert kind == "OwnerGone" and "buffer 'doomed': its owner, rank 0 of mesh" in msg, (kind, msg)

        # Later: refused at once, from the reader and from the controller.
        kind, msg, took = reader.try_read.call_one(buf).get(timeout=30)
        assert kind == "OwnerGone" and took < 1.0, (kind, msg, took)
        t0 = time.monotonic()
        with pytest.raises(OwnerGone, match="is gone"):
            buf.read_into(bytearray(buf.size)).get(timeout=10)
        assert time.monotonic() - t0 < 1.0
        assert not _shm_entries([pid])


def test_cuda_ipc_between_gpu_ranks():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        pytest.skip("no CUDA device here: the cuda_ipc transport needs a GPU")
    with this_host().spawn_procs(per_host={"ranks": 2}) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        reader = procs.slice(ranks=1).spawn("reader", Reader)
        buf = owner.make_gpu.call_one(1 << 20).get(timeout=60)
        transport, got = reader.read_gpu.call_one(buf).get(timeout=60)
        assert transport == "cuda_ipc"
        assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32))


def _ip(*args: str) -> None:
    import subprocess

    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: two hosts, as far as sockets can tell."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces (`make test` installs iproute2)")
    tag = os.urandom(3).hex()
    a, b = f"mk-a-{tag}", f"mk-b-{tag}"
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    made = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield a, b, f"{net}.1"
    finally:
        for ns in made:
            _ip("netns", "delete", ns)  # takes the veth pair with it


def test_ranks_on_two_hosts_pick_tcp_and_move_64_mib(two_hosts):
    ns_a, ns_b, addr_a = two_hosts
    with this_host().spawn_procs(per_host={"ranks": 2}, name="host_a", env={"MONARCH_KERNEL_NETNS": ns_a}) as pa, \
         this_host().spawn_procs(per_host={"ranks": 1}, name="host_b", env={"MONARCH_KERNEL_NETNS": ns_b}) as pb:
        owner = pa.slice(ranks=0).spawn("owner", Owner)
        reader = pb.spawn("reader", Reader)
        buf, expect = owner.make.call_one("across", 64 * MiB, seed=11).get(timeout=60)
        assert buf._h.addresses[0] == addr_a  # advertised from inside host A's namespace
        assert reader.read_crc.call_one(buf).get(timeout=90) == ("tcp", expect)
        # A neighbour in host A's namespace uses shared memory.
        local = pa.slice(ranks=1).spawn("local_reader", Reader)
        assert local.read_crc.call_one(buf).get(timeout=90) == ("shm", expect)


def test_ibverbs_extension_is_built_and_reports_honestly():
    from monarch_kernel.data import ibverbs

    if not os.path.exists("/usr/include/infiniband/verbs.h"):
        pytest.skip("libibverbs-dev is not installed, so the extension was not built (`make test` installs it as root)")
    from monarch_kernel.data import _ibverbs  # built by pip install whenever the headers exist
    ok, why = _ibverbs.probe()
    assert (ok, why) == ibverbs.is_available()
    assert {t["name"]: t["available"] for t in transports()}["ibverbs"] is ok
    # Debian's pyverbs, set up from the same rdma-core, agrees on whether a device exists.
    import sys

    sys.path.append("/usr/lib/python3/dist-packages")
    try:
        import pyverbs.device as pyverbs_device
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        pyverbs_device = None
    finally:
        sys.path.remove("/usr/lib/python3/dist-packages")
    if pyverbs_device is not None:
        try:
            devices = pyverbs_device.get_device_list()
        except PyverbsError:
            devices = []
        assert bool(devices) is ok
    if not ok:
        assert why.startswith("no RDMA device")
        with pytest.raises(OSError, match="no RDMA device"):
            _ibverbs.Endpoint()
        pytest.skip(f"ibverbs transfers need an RDMA NIC: {why}")


def test_ibverbs_read_and_write_between_ranks():
    from monarch_kernel.data import ibverbs

    ok, why = ibverbs.is_available()
    if not ok:
        pytest.skip(f"ibverbs transfers need an RDMA NIC: {why}")
    env = {"MONARCH_KERNEL_DATA_TRANSPORT": "ibverbs"}
    with this_host().spawn_procs(per_host={"ranks": 2}, env=env) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        reader = procs.slice(ranks=1).spawn("reader", Reader)
        buf, expect = owner.make.call_one("rdma", 64 * MiB, seed=5).get(timeout=60)
        assert reader.read_crc.call_one(buf).get(timeout=60) == ("ibverbs", expect)
        src = pattern(MiB, seed=6)
        reader.write.call_one(buf, src, MiB).get(timeout=60)
        assert torch.equal(owner.get.call_one("rdma").get(timeout=30)[MiB:2 * MiB], src)


# ---------------------------------------------------------------- the wire, and what importing does


def test_every_op_and_status_keeps_its_code():
    """The numbers are the protocol: a rank of another build must read them the same."""
    assert {o.name: int(o) for o in wire.Op} == {
        "READ": 1, "WRITE": 2, "MAP": 3, "CHECK": 4, "DROP": 5, "IB_CONNECT": 6, "LIVE": 7}
    assert {s.name: int(s) for s in wire.Status} == {
        "OK": 0, "GONE": 1, "FORGED": 2, "RANGE": 3, "STALE": 4, "READONLY": 5, "NOT_SHARED": 6,
        "RDMA_SETUP": 7}
    assert (wire.REQUEST.format, wire.REPLY.format, wire.LENGTH.format) == ("<BQ16sQQ", "<BI", "<I")


@pytest.mark.parametrize("op", [*wire.Op, 200], ids=[*(o.name for o in wire.Op), "unknown"])
def test_request_round_trips(op):
    req = wire.Request(op, (1 << 62) - 1, bytes(range(16)), 1 << 40, 12345)
    raw = req.encode()
    assert len(raw) == wire.REQUEST.size == 41
    back = wire.Request.decode(raw)
    assert back == req
    # Known ops come back typed; an op this end does not know stays a number (answered RANGE).
    assert type(back.op) is (wire.Op if op != 200 else int)


@pytest.mark.parametrize("status", [*wire.Status, 99], ids=[*(s.name for s in wire.Status), "unknown"])
def test_reply_round_trips(status):
    rep = wire.Reply(status, "why: ünïcode".encode())
    raw = rep.encode()
    head, rest = raw[:wire.REPLY.size], raw[wire.REPLY.size:]
    assert wire.decode_reply_head(head) == (status, len(rep.message)) and rest == rep.message
    assert type(wire.decode_reply_head(head)[0]) is (wire.Status if status != 99 else int)


def test_requests_blobs_and_replies_round_trip_over_a_socket():
    class H:  # what send_request reads of a handle
        id, token = 7, b"t" * 16

    a, b = socket.socketpair()
    with a, b:
        wire.send_request(a, wire.Op.IB_CONNECT, H, 3, 4, b'{"qpn": 1}')
        wire.send_request(a, wire.Op.CHECK, H, 0, 10)
        assert wire.recv_request(b) == wire.Request(wire.Op.IB_CONNECT, 7, b"t" * 16, 3, 4)
        assert wire.recv_blob(b) == b'{"qpn": 1}'
        assert wire.recv_request(b) == wire.Request(wire.Op.CHECK, 7, b"t" * 16, 0, 10)
        wire.send_reply(b, wire.Status.RDMA_SETUP, b"no NIC")
        wire.send_reply(b, wire.Status.OK)
        assert wire.recv_reply(a) == wire.Reply(wire.Status.RDMA_SETUP, b"no NIC")
        assert wire.recv_reply(a) == wire.Reply(wire.Status.OK, b"")


def test_a_reader_that_exits_leaves_no_socket_to_the_gc(tmp_path):
    """The reader's watch on an owner (an idle connection, liveness.py) is closed at exit,
    like its pooled connections: none is left for the GC to warn about."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent("""
        import torch
        from monarch_kernel import Actor, RDMABuffer, endpoint, this_host

        class Owner(Actor):
            @endpoint
            def make(self, n):
                self.t = torch.arange(n, dtype=torch.uint8)
                return RDMABuffer(self.t, name="b")

        with this_host().spawn_procs(per_host={"ranks": 1}) as procs:
            buf = procs.spawn("owner", Owner).make.call_one(4096).get(timeout=60)
            dst = torch.empty(4096, dtype=torch.uint8)
            for _ in range(3):  # the second read on asks the owner's words (the watch)
                buf.read_into(dst).get(timeout=60)
            print(buf.transport(), int(dst.sum()))
    """))
    env = {**os.environ, "MONARCH_KERNEL_DATA_TRANSPORT": "shm"}
    out = subprocess.run([sys.executable, "-W", "always::ResourceWarning", str(script)], capture_output=True,
                         text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["shm", str(sum(range(256)) * 16)]
    assert "ResourceWarning" not in out.stderr, out.stderr


def test_importing_the_data_plane_installs_nothing():
    """Every module of monarch_kernel.data, imported after the layers it sits on, leaves the
    environment, exit and fork handlers, hooks, signals and threads as they were."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import atexit, copyreg, os, pkgutil, signal, sys, threading
        import monarch_kernel, monarch_kernel.actor.future, monarch_kernel.runtime.completion
        import monarch_kernel.runtime.config, monarch_kernel.runtime.context
        import monarch_kernel.runtime.net.hosts, monarch_kernel.runtime.process
        import msgpack

        installed = []  # (what, by which module) for every fork or exit handler registered meanwhile

        def recorder(what, real):
            def record(*args, **kw):
                installed.append((what, sys._getframe(1).f_globals.get("__name__")))
                return real(*args, **kw)
            return record

        os.register_at_fork = recorder("os.register_at_fork", os.register_at_fork)
        atexit.register = recorder("atexit.register", atexit.register)

        def state():
            return (dict(os.environ), atexit._ncallbacks(), sys.breakpointhook, sys.excepthook,
                    sys.displayhook, threading.excepthook, threading.active_count(),
                    dict(copyreg.dispatch_table), list(sys.meta_path), sys.getprofile(), sys.gettrace(),
                    {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)})

        import concurrent.futures.thread  # registers a fork handler of its own when imported

        before = state()
        import monarch_kernel.data as data
        names = sorted(m.name for m in pkgutil.iter_modules(data.__path__) if not m.name.startswith("_"))
        for name in names:
            __import__("monarch_kernel.data." + name)
        assert state() == before, [a for a, b in zip(state(), before) if a != b]
        # The standard library may register its own (concurrent.futures does); the data plane may not.
        assert not [i for i in installed if i[1].startswith("monarch_kernel")], installed
        print(" ".join(names))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["action", "buffer", "client", "cuda_ipc", "errors", "ibverbs", "liveness",
                                  "memory", "order", "server", "shm", "tcp", "transfer", "transports", "wire"]


# ---------------------------------------------------------------- a failed RDMA set-up on the owner


def test_a_failed_rdma_setup_on_the_owner_is_its_own_error_naming_the_device():
    """The owner is told to use an RDMA device that does not exist: its half of IB_CONNECT
    fails for real (opening the device), and the reader gets RdmaSetupFailed (not the
    ValueError a bad range gives) naming the owner, the device and the step; the connection
    stays in step for the next request."""
    from monarch_kernel.data import RdmaSetupFailed, client, ibverbs

    env = {"MONARCH_KERNEL_IB_DEVICE": "mk-no-such-nic", "MONARCH_KERNEL_IB_PORT": "2"}
    with this_host().spawn_procs(per_host={"ranks": 1}, name="nic_owner", env=env) as procs:
        owner = procs.spawn("owner", Owner)
        buf, _ = owner.make.call_one("nic", 4096).get(timeout=30)
        h, key = buf._h, Runtime.current().key
        # What a reader's Endpoint.info() holds; the owner fails before it uses any of it.
        mine = {"lid": 1, "gid": bytes(16), "qpn": 0x1234, "psn": 0x42, "mtu": 4}
        with client.Connection(h, "tcp", key, 10.0) as sock:
            with pytest.raises(RdmaSetupFailed) as got:
                ibverbs.request_connect(sock, h, mine)
            assert not isinstance(got.value, ValueError)
            assert isinstance(got.value, TransferError)
            msg = str(got.value)
            assert msg.startswith("buffer 'nic': RDMA set-up failed on its owner, "
                                  "rank 0 of mesh 'nic_owner' (pid "), msg
            assert "while opening RDMA device 'mk-no-such-nic' (port 2, GID index 0): " in msg, msg
            # Whatever this host has: no device of that name, or no extension to open one with.
            assert "no RDMA device" in msg or "native" in msg or "_ibverbs" in msg, msg
            assert msg.endswith("Set MONARCH_KERNEL_IB_DEVICE (and _PORT, _GID_INDEX) on the owner to a device "
                                "that works there (transports() lists them), or MONARCH_KERNEL_DATA_TRANSPORT=tcp")
            # The owner read the whole request, queue-pair details included: the next one is answered.
            assert client.request(sock, h, wire.Op.CHECK, 0, h.size) == b""
            # A refused IB_CONNECT (a forged token) also consumes its details and keeps the stream in step.
            forged = replace(h, token=b"\x00" * 16)
            with pytest.raises(ForgedHandle, match="wrong token for buffer 'nic'"):
                ibverbs.request_connect(sock, forged, mine)
            assert client.request(sock, h, wire.Op.CHECK, 0, h.size) == b""
