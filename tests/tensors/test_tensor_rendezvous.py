"""The rendezvous of the ranks' process groups (tensors/rank/store.py over a port of the
controller, tensors/rendezvous_actor.py) on real ranks: it answers as torch's own store does
(checked op by op against torch's HashStore, through torch's PrefixStore), a wait blocks its
caller only, until a peer sets the key or its timeout passes (naming the key), two
activations never meet each other's keys, and the keys go when the mesh stops."""

from __future__ import annotations

import datetime
import time

import pytest

from monarch_kernel import Actor, MeshStopped, ProcessDied, endpoint, inspect, this_host
from monarch_kernel.tensors.controller.registry import tensor_client
from monarch_kernel.tensors.rendezvous_actor import serve_rendezvous

pytestmark = pytest.mark.timeout(180)
torch = pytest.importorskip("torch")


class StoreUser(Actor):
    def _store(self, rendezvous, timeout_s: float = 30.0):
        from monarch_kernel.tensors.rank.store import MeshStore

        return MeshStore(rendezvous.keeper, datetime.timedelta(seconds=timeout_s))

    @endpoint
    def same_as_torch(self, rendezvous) -> list:
        """One sequence of operations on a MeshStore and on torch's HashStore, each through
        torch's PrefixStore (its C++ calls our Python methods): both answers, side by side."""
        import torch.distributed as dist

        ref = dist.HashStore()
        ref.set_timeout(datetime.timedelta(seconds=30))
        out = []
        ours = self._store(rendezvous)  # (held: torch keeps only its C++ half)
        for store in (dist.PrefixStore("p", ours), dist.PrefixStore("p", ref)):
            got = []
            store.set("a", "1")
            store.set("b", b"\x00\xff")
            got += [store.get("a"), store.get("b"), store.add("n", 5), store.add("n", -2), store.get("n")]
            got += [store.compare_set("c", "", "new"), store.compare_set("c", "old", "x"),
                    store.compare_set("c", "new", "newer"), store.compare_set("absent", "x", "y"), store.get("c")]
            store.append("a", "23")
            store.multi_set(["m1", "m2"], ["x", "y"])
            got += [store.get("a"), store.multi_get(["m1", "m2"]), store.check(["a", "m1"]), store.check(["zz"])]
            got += [store.delete_key("a"), store.delete_key("a"), store.check(["a"]), store.num_keys()]
            store.wait(["b", "m2"])
            store.wait(["m1"], datetime.timedelta(seconds=5))
            got.append(store.clone().get("b"))  # (torch's C++ asks ours for a clone)
            out.append(got)
        return out

    @endpoint
    def get_later(self, rendezvous, key: str, timeout_s: float) -> tuple:
        start = time.monotonic()
        try:
            value = self._store(rendezvous, timeout_s).get(key)
        except Exception as e:  # noqa: BLE001  (the test reads what it was)
            return type(e).__name__, str(e), time.monotonic() - start
        return "value", value, time.monotonic() - start

    @endpoint
    def set_many(self, rendezvous, key: str, n: int) -> float:
        """``n`` adds, then ``key`` set: the slowest add's seconds."""
        store = self._store(rendezvous)
        slowest = 0.0
        for _ in range(n):
            start = time.monotonic()
            store.add("counter", 1)
            slowest = max(slowest, time.monotonic() - start)
        store.set(key, b"here")
        return slowest

    @endpoint
    def get_now(self, rendezvous, key: str):
        store = self._store(rendezvous, 2.0)
        return store.get(key) if store.check([key]) else None


@pytest.fixture(scope="module")
def mesh():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        yield procs, procs.spawn("users", StoreUser)


@pytest.fixture
def kept():
    server, rendezvous = serve_rendezvous(["here"])
    yield server, rendezvous
    server.close()


@pytest.fixture
def rendezvous(kept):
    return kept[1]


def _until(what: str, check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.02)


def test_it_answers_as_torchs_own_store(mesh, rendezvous):
    _procs, users = mesh
    ours, torchs = users.slice(gpus=0).same_as_torch.call_one(rendezvous).get(timeout=60)
    assert ours == torchs
    assert ours[:5] == [b"1", b"\x00\xff", 5, 3, b"3"]


def test_a_wait_blocks_its_caller_only_until_a_peer_sets_the_key(mesh, kept):
    _procs, users = mesh
    server, rendezvous = kept
    waiting = users.slice(gpus=0).get_later.call_one(rendezvous, "late", 60.0)
    _until("rank 0's get of 'late' to wait in the controller", lambda: server.table.waiting() == {"late": 1})
    # the keeper serves others meanwhile
    slowest = users.slice(gpus=1).set_many.call_one(rendezvous, "late", 20).get(timeout=60)
    assert slowest < 5.0, f"an add took {slowest:.1f} s while a wait was pending"
    what, value, _took = waiting.get(timeout=60)
    assert (what, value) == ("value", b"here")
    assert server.table.waiting() == {}


def test_a_key_no_rank_sets_times_out_naming_it(mesh, rendezvous):
    _procs, users = mesh
    what, message, took = users.slice(gpus=0).get_later.call_one(rendezvous, "never", 1.0).get(timeout=60)
    assert what == "DistStoreError" and "['never']" in message and "collective_timeout" in message, message
    assert 0.9 <= took < 15, took


def test_two_activations_never_meet_each_others_keys(mesh, rendezvous):
    _procs, users = mesh
    other_server, other = serve_rendezvous(["here"])
    try:
        assert other != rendezvous and other.prefix != rendezvous.prefix
        users.slice(gpus=1).set_many.call_one(rendezvous, "k", 1).get(timeout=60)
        assert users.slice(gpus=0).get_now.call_one(rendezvous, "k").get(timeout=60) == b"here"
        assert users.slice(gpus=0).get_now.call_one(other, "k").get(timeout=60) is None
    finally:
        other_server.close()


def test_the_keys_go_when_the_mesh_stops_and_a_pending_wait_fails_then():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        with procs.activate():
            total = procs.rank_tensor("gpus").float().reduce("gpus", "sum")
        assert float(inspect(total)) == 1.0
        backend = tensor_client(procs).backend
        server, rendezvous = backend.rendezvous_server, backend.rendezvous
        assert server.table.num_keys() > 0  # the reduce's group's keys
        users = procs.spawn("users", StoreUser)
        pending = users.slice(gpus=0).get_later.call_one(rendezvous, "never", 120.0)
        _until("rank 0's wait to reach the controller", lambda: server.table.waiting() == {"never": 1})
        procs.stop().get(timeout=30)  # (before the ranks go: the wait's answer still reaches rank 0)
    # the mesh stopped: its keys with it, and the wait failed then, not in 120 s
    assert server.table.num_keys() == 0 and server.table.waiting() == {}
    try:
        what, message, took = pending.get(timeout=30)
    except (MeshStopped, ProcessDied):
        return  # rank 0 went before the answer reached it
    assert what == "ActorError" and "the rendezvous was closed" in message and took < 60, (what, message, took)
