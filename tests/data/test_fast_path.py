"""RDMABuffer reads with no fixed cost beyond what they need (issue 46), between real rank
processes: a buffer read before is copied without its owner (a frozen owner still serves
it), a drop or a death is still seen at once, a handle's signature is checked once per
handle and a forged one never rides that check, a small read finishes on the caller's
thread, and large shm copies are split over a bounded number of threads."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import astuple, replace

import pytest
import torch
from support.buffers import MiB, crc, pattern
from support.config import configured
from support.freeze import freeze

from monarch_kernel import Actor, RDMABuffer, endpoint, this_host
from monarch_kernel.data import ForgedHandle, OwnerGone
from monarch_kernel.data import memory as data_memory
from monarch_kernel.data.buffer import Handle, _rebuild
from monarch_kernel.runtime import config

pytestmark = pytest.mark.timeout(120)

class Owner(Actor):
    def __init__(self):
        self.kept: dict = {}

    @endpoint
    def make(self, name: str, n: int, seed: int = 0) -> tuple:
        self.kept[name] = t = pattern(n, seed)
        return RDMABuffer(t, name=name), crc(t)

    @endpoint
    def crc_of(self, name: str, lo: int = 0, hi: int | None = None) -> int:
        return crc(self.kept[name][lo:hi])

    @endpoint
    def fill(self, name: str, value: int) -> None:
        self.kept[name].fill_(value)

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop()

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Reader(Actor):
    @endpoint
    def read_crc(self, buf: RDMABuffer, n: int | None = None, offset: int = 0) -> tuple:
        dst = torch.empty(buf.size - offset if n is None else n, dtype=torch.uint8)
        buf.read_into(dst, offset).get(timeout=60)
        return buf.transport(), crc(dst)

    @endpoint
    def write(self, buf: RDMABuffer, src, offset: int = 0) -> None:
        buf.write_from(src, offset).get(timeout=60)

    @endpoint
    def try_read(self, buf: RDMABuffer) -> str:
        try:
            buf.read_into(torch.empty(buf.size, dtype=torch.uint8)).get(timeout=30)
        except Exception as e:  # noqa: BLE001 - the kind is the answer
            return f"{type(e).__name__}: {e}"
        return "ok"

    @endpoint
    def verifications(self, buf: RDMABuffer, reads: int) -> int:
        """How many times the handle's signature is computed over ``reads`` reads."""
        seen = []
        original = Handle.verify

        def counting(h, key):
            seen.append(1)
            return original(h, key)

        Handle.verify = counting  # type: ignore[method-assign]
        try:
            dst = torch.empty(buf.size, dtype=torch.uint8)
            for _ in range(reads):
                buf.read_into(dst).get(timeout=30)
        finally:
            Handle.verify = original  # type: ignore[method-assign]
        return len(seen)

    @endpoint
    def forged_after_genuine(self, buf: RDMABuffer, key_hex: str) -> tuple:
        """Read with the genuine handle, then with copies whose fields were altered: one
        unsigned, one signed with the job's key but with a guessed token."""
        dst = torch.empty(buf.size, dtype=torch.uint8)
        buf.read_into(dst).get(timeout=30)
        buf.read_into(dst).get(timeout=30)
        h = buf._h
        out = []
        for forged in (replace(h, name="other"), replace(h, token=b"\x01" * 16).sign(bytes.fromhex(key_hex))):
            try:
                _rebuild(astuple(forged)).read_into(dst).get(timeout=30)
                out.append("read")
            except ForgedHandle as e:
                out.append(str(e))
        return tuple(out)

    @endpoint
    def finishing_threads(self, buf: RDMABuffer) -> list:
        """The thread each of three small reads finishes on (``then`` runs there)."""
        dst = torch.empty(buf.size, dtype=torch.uint8)
        names = []
        for _ in range(3):
            fut = buf.read_into(dst)
            fut.then(lambda _f: names.append(threading.current_thread().name))
            fut.get(timeout=30)
        return names

    @endpoint
    def copy_threads(self) -> int:
        return sum(t.name.startswith("mk-copy") for t in threading.enumerate())


@pytest.fixture(scope="module")
def pair():
    with this_host().spawn_procs(per_host={"ranks": 2}, env={"MONARCH_KERNEL_DATA_TRANSPORT": "shm"}) as procs:
        yield procs.slice(ranks=0).spawn("owner", Owner), procs.slice(ranks=1).spawn("reader", Reader)


def test_a_buffer_read_before_is_copied_without_its_owner_and_sees_its_writes(pair):
    """Frozen (SIGSTOP), the owner cannot answer; a buffer this reader has mapped is still
    read, and what the owner wrote before it froze is what arrives."""
    owner, reader = pair
    buf, _ = owner.make.call_one("seen", 3 * MiB + 5, seed=3).get(timeout=30)
    reader.read_crc.call_one(buf).get(timeout=30)
    owner.fill.call_one("seen", 7).get(timeout=30)
    expect = owner.crc_of.call_one("seen").get(timeout=30)
    pid = owner.pid.call_one().get(timeout=10)
    freeze(pid)
    try:
        assert reader.read_crc.call_one(buf).get(timeout=20) == ("shm", expect)
        assert reader.read_crc.call_one(buf, 4096, 3 * MiB + 5 - 4096).get(timeout=20)[1] == crc(bytes([7] * 4096))
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_drop_is_seen_by_the_next_read_without_a_check(pair):
    owner, reader = pair
    buf, expect = owner.make.call_one("dropped", MiB).get(timeout=30)
    assert reader.read_crc.call_one(buf).get(timeout=30) == ("shm", expect)
    owner.drop.call_one(buf).get(timeout=30)
    got = reader.try_read.call_one(buf).get(timeout=30)
    assert got.startswith("BufferDropped") and "'dropped' was dropped by its owner" in got, got


def test_a_handle_is_verified_once_and_a_forged_one_never_rides_it(pair):
    owner, reader = pair
    buf, _ = owner.make.call_one("signed", 4096).get(timeout=30)
    assert reader.verifications.call_one(buf, 20).get(timeout=30) == 1
    from monarch_kernel.runtime.process import Runtime

    unsigned, guessed = reader.forged_after_genuine.call_one(buf, Runtime.current().key.hex()).get(timeout=30)
    assert "does not carry a valid signature" in unsigned
    assert "wrong token for buffer 'signed'" in guessed


def test_small_reads_finish_on_the_callers_thread(pair):
    owner, reader = pair
    buf, _ = owner.make.call_one("small", 4096).get(timeout=30)
    names = reader.finishing_threads.call_one(buf).get(timeout=30)
    # The first maps the buffer (a round trip, on a worker); the others are bare copies.
    assert not any(n.startswith("mk-data") for n in names[1:]), names


def test_the_owners_death_is_still_an_error_at_once_after_bare_copies():
    with this_host().spawn_procs(per_host={"ranks": 2}, env={"MONARCH_KERNEL_DATA_TRANSPORT": "shm"}) as procs:
        owner = procs.slice(ranks=0).spawn("owner", Owner)
        reader = procs.slice(ranks=1).spawn("reader", Reader)
        buf, expect = owner.make.call_one("mortal", MiB).get(timeout=30)
        for _ in range(3):
            assert reader.read_crc.call_one(buf).get(timeout=30) == ("shm", expect)
        pid = owner.pid.call_one().get(timeout=10)
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        got = reader.try_read.call_one(buf).get(timeout=30)
        assert got.startswith(OwnerGone.__name__) and "buffer 'mortal'" in got, got


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` has closed its descriptors: every thread has exited (the first thread's
    zombie state alone says nothing of the others, which share the descriptors)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.listdir(f"/proc/{pid}/task") == [str(pid)] and not os.listdir(f"/proc/{pid}/fd"):
                return  # the first thread, a zombie, alone
        except (FileNotFoundError, PermissionError):
            return
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for pid {pid} to close its files"
        time.sleep(0.01)


# ---------------------------------------------------------------- parallel copies


@pytest.mark.parametrize("n", [0, 1, 4093, 16 * MiB - 1, 16 * MiB, 64 * MiB + 4093, 1 << 30])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_copy_is_split_within_the_bound_and_covers_every_byte(n, threads):
    parts = data_memory.parts(n, threads)
    assert 1 <= len(parts) <= threads
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))  # no gap, no overlap
    assert all(lo % data_memory.PAGE == 0 for lo, _ in parts)
    if n < data_memory.PARALLEL_MIN:
        assert len(parts) == 1
    else:
        assert all(hi - lo >= data_memory.PART_MIN for lo, hi in parts[:-1])


def test_parallel_copies_in_this_process_are_exact_at_odd_sizes_and_offsets():
    src = pattern(40 * MiB + 4093, seed=9)
    for threads in (1, 2, 3, 5):
        for lo, hi in ((0, src.numel()), (4093, src.numel()), (1, 33 * MiB + 7)):
            dst = torch.zeros(hi - lo, dtype=torch.uint8)
            data_memory.copy(memoryview(dst.numpy()), memoryview(src.numpy())[lo:hi], threads)
            assert torch.equal(dst, src[lo:hi]), (threads, lo, hi)
    assert sum(t.name.startswith("mk-copy") for t in threading.enumerate()) <= 4  # bound 5: 4 workers


def test_the_copy_threads_setting_reaches_the_ranks():
    assert config.setting("data_copy_threads").env == "MONARCH_KERNEL_DATA_COPY_THREADS"
    n = 48 * MiB + 4093
    with configured(data_copy_threads=3):
        with this_host().spawn_procs(per_host={"ranks": 2}, env={"MONARCH_KERNEL_DATA_TRANSPORT": "shm"}) as procs:
            owner = procs.slice(ranks=0).spawn("owner", Owner)
            reader = procs.slice(ranks=1).spawn("reader", Reader)
            buf, expect = owner.make.call_one("big", n, seed=4).get(timeout=60)
            for _ in range(2):  # the second is a bare copy
                assert reader.read_crc.call_one(buf).get(timeout=60) == ("shm", expect)
            tail = owner.crc_of.call_one("big", 4093).get(timeout=30)
            assert reader.read_crc.call_one(buf, n - 4093, 4093).get(timeout=60)[1] == tail
            src = pattern(40 * MiB + 3, seed=5)
            reader.write.call_one(buf, src, 4093).get(timeout=60)
            reader.write.call_one(buf, src, 4093).get(timeout=60)
            assert owner.crc_of.call_one("big", 4093, 4093 + src.numel()).get(timeout=30) == crc(src)
            assert 1 <= reader.copy_threads.call_one().get(timeout=30) <= 2  # bound 3: this thread and 2

