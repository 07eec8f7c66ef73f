"""Distributed tensors: torch code inside ``procs.activate()`` runs on every rank, the
controller holds handles whose shapes it knows at once, and values come back only when
fetched.  One 4-rank mesh for the module (its ranks import torch once); a rank's death gets
a small mesh of its own, last."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from support.actors import wait_for  # noqa: E402
from support.config import configured  # noqa: E402

import monarch_kernel as mk  # noqa: E402
from monarch_kernel import (  # noqa: E402
    Actor,
    Channel,
    ProcessDied,
    RemoteException,
    Tensor,
    call_on_shard_and_fetch,
    endpoint,
    fetch_shard,
    get_active_mesh,
    inspect,
    no_mesh,
    remote,
    send,
    show,
    this_host,
)
from monarch_kernel.tensors.controller.registry import tensor_client  # noqa: E402

pytestmark = pytest.mark.timeout(150)


class Linear(Actor):
    def __init__(self):
        self.w = torch.eye(3) * 2

    @endpoint(propagate=lambda x: x)
    def forward(self, x):
        return x @ self.w

    @endpoint
    def total(self, t) -> float:
        return float(t.sum())

    @endpoint
    def pause(self, seconds: float) -> None:
        threading.Event().wait(seconds)


@remote(propagate=lambda x: x)
def doubled(x):
    return 2 * x


@remote
def pid():
    return os.getpid()


def _rank_state():
    """State a rank keeps between ops (these functions travel by value, so not in globals):
    ``gate``, opened by the main stream and awaited on a comms stream; ``ran``, the backward
    passes of ``traced`` that ran."""
    import types

    return sys.modules.setdefault("_monarch_kernel_test_state", types.SimpleNamespace(gate=threading.Event(),
                                                                                      ran=[]))


@remote(propagate=lambda: torch.empty(()))
def wait_for_gate():
    return torch.tensor(float(_rank_state().gate.wait(30)))


@remote(propagate=lambda: torch.empty(()))
def open_gate():
    _rank_state().gate.set()
    return torch.tensor(1.0)


@remote(propagate=lambda: torch.empty((), dtype=torch.int64))
def backward_passes():
    return torch.tensor(len(_rank_state().ran))


@mk.grad_function
def traced(x):
    def backward(g):
        _rank_state().ran.append(1)
        return g * 3  # not the true gradient: this function's own
    return x * 1, backward


@pytest.fixture(scope="module")
def procs():
    with this_host().spawn_procs(per_host={"gpus": 4}) as pm:
        yield pm


def _refs(procs) -> list[int]:
    client = tensor_client(procs)
    return [v["refs"] for v in client.backend.stats(client.flush()).get(timeout=60).values()]


def test_importing_the_package_does_not_import_torch():
    code = "import sys, monarch_kernel as m; m.__all__; m.ProcMesh.activate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_shapes_are_known_at_once_and_values_come_from_each_rank(procs):
    with procs.activate() as active:
        assert active is procs and get_active_mesh() is procs
        t = torch.rand(3, 4)
        u = t @ t.T
        r = procs.rank_tensor("gpus")
        scaled = torch.ones(2, 2) * r
    assert get_active_mesh() is None
    assert isinstance(u, Tensor) and isinstance(u, torch.Tensor)
    assert u.shape == (3, 3) and u.dtype == torch.float32 and u.mesh is procs
    assert repr(u) == (f"monarch_kernel.Tensor(mesh='{procs.name}' {{gpus=4}}, shape=[3, 3], dtype=torch.float32, "
                       "device=cpu)")
    shards = [fetch_shard(t, gpus=i).get(timeout=60) for i in range(4)]
    assert all(s.shape == (3, 4) for s in shards)
    assert not torch.equal(shards[0], shards[1]), "each rank draws its own random values"
    torch.testing.assert_close(inspect(u, gpus=2), shards[2] @ shards[2].T)
    assert [int(inspect(r, gpus=i)) for i in range(4)] == [0, 1, 2, 3]
    assert inspect(scaled, {"gpus": 3}).tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert "gpus=1" in repr(show(r, gpus=range(2))) and "<table>" in show(r, gpus=None)._repr_html_()


def test_live_tensors_are_listed_per_mesh(procs):
    from monarch_kernel.tensors.controller.registry import live_tensors

    with procs.activate():
        t = torch.zeros(16, 4, dtype=torch.float64)
    rows = live_tensors()[procs.name]
    assert {"shape": [16, 4], "dtype": "float64", "device": "cpu", "bytes": 512} in rows
    del t


def test_ops_outside_activate_run_on_the_tensors_own_mesh(procs):
    # As in Monarch: the mesh comes from the first distributed tensor; activate() only
    # says where factories make tensors.
    with procs.activate():
        t = procs.rank_tensor("gpus").float() + torch.ones(2)  # rank i holds [i + 1, i + 1]
        w = torch.nn.Linear(2, 1)
    u = torch.relu(t - 2) * 10 + t  # no activate()
    assert type(u) is Tensor and u.mesh is procs and u.shape == (2,)
    assert [inspect(u, gpus=i).tolist() for i in range(4)] == [[1.0] * 2, [2.0] * 2, [13.0] * 2, [24.0] * 2]
    out = w(t).sum()  # a distributed module, and autograd, outside activate() too
    out.backward()
    assert w.weight.grad.shape == (1, 2) and inspect(w.weight.grad, gpus=3).tolist() == [[4.0, 4.0]]
    assert inspect(doubled(t), gpus=1).tolist() == [4.0, 4.0]  # a remote function: the tensor's mesh
    with pytest.raises(RuntimeError, match=r"inspect\(t\)"):
        t.item()
    assert type(torch.zeros(2)) is torch.Tensor  # a factory with no mesh active: local, as before
    with procs.activate():
        with no_mesh.activate():
            assert type(torch.zeros(2)) is torch.Tensor
            v = t + 1  # no_mesh makes factories local; ops on distributed tensors stay on their mesh
    assert inspect(v, gpus=2).tolist() == [4.0, 4.0]


def test_mixing_meshes_or_a_local_tensor_raises_on_its_line(procs):
    with procs.activate():
        t = torch.ones(4)
    half = procs.slice(gpus=slice(0, 2))
    with half.activate():
        h = torch.ones(4)
    here = torch.ones(4)
    for activated in (False, True):
        with procs.activate() if activated else no_mesh.activate():
            with pytest.raises(ValueError, match=r"add\(\): a tensor of mesh 'procs\d*' \{gpus=2\} used with one "
                                                 r"of mesh 'procs\d*' \{gpus=4\}.*t.to_mesh\(mesh\)"):
                t + h
            with pytest.raises(ValueError, match=r"add\(\): a local tensor \(shape \[4\], on the controller\) "
                                                 r"used with a distributed one of mesh 'procs\d*' \{gpus=4\}"):
                t + here
            with pytest.raises(ValueError, match="a local tensor"):
                torch.cat([t, here])
    assert inspect(t + 1).tolist() == [2.0] * 4  # nothing was recorded by the lines that raised


def test_failures_poison_what_depends_on_them_and_the_ranks_go_on(procs):
    with procs.activate():
        a = torch.ones(3, 3)
        with pytest.raises(RuntimeError, match="same reduction dim"):
            a @ torch.ones(4, 4)  # the controller sees the shapes: raised on this line
        bad = a[torch.tensor([5])]  # only the ranks see the index
        worse = bad.sum() + 1
        fine = a + 1
    for v in (bad, worse):
        with pytest.raises(RemoteException, match="failed on rank 1") as info:
            inspect(v, gpus=1)
        assert "IndexError: index 5 is out of bounds" in info.value.remote_traceback
    assert inspect(fine).tolist() == [[2.0] * 3] * 3


def test_dropped_handles_free_the_ranks_tensors(procs):
    gc.collect()
    before = _refs(procs)
    with procs.activate():
        x = torch.zeros(8)
        for _ in range(3000):
            x = x + 1
    assert inspect(x)[0] == 3000
    assert _refs(procs) == [b + 1 for b in before]
    del x
    gc.collect()
    assert _refs(procs) == before


def test_a_fetch_does_not_wait_on_deletes_and_they_still_reach_the_ranks():
    with configured(tensor_flush=0.5):  # deletes a fetch left go 5 s later: the fetch is seen alone
        with this_host().spawn_procs(per_host={"gpus": 2}) as pm:
            with pm.activate():
                x = torch.ones(2)
                y = x * 2
            assert inspect(y).tolist() == [2.0, 2.0]
            client = tensor_client(pm)
            sent = client.seq
            del y
            gc.collect()
            assert inspect(x).tolist() == [1.0, 1.0]  # y's delete alone is no reason to wake every rank
            assert client.seq == sent
            wait_for(lambda: client.seq > sent, timeout=30)  # the flusher sent the delete on its own
            stats = client.backend.stats(client.seq).get(timeout=60)  # (no flush of its own)
            assert [v["refs"] for v in stats.values()] == [1, 1]  # x alone is left


def test_a_temporary_passed_to_an_endpoint_lives_until_the_call_is_answered():
    with configured(tensor_flush=0.001):  # a dead handle's delete leaves within milliseconds
        with this_host().spawn_procs(per_host={"gpus": 2}) as pm:
            lin = pm.spawn("lin", Linear)
            with pm.activate():
                x = torch.ones(3)
            busy = lin.pause.call(1.0)  # the call below waits in the actors' inboxes meanwhile
            with pm.activate():
                got = lin.total.call(x * 2)  # a temporary: nothing here holds it once it is pickled
            gc.collect()
            assert list(got.get(timeout=60).values()) == [6.0, 6.0]  # its shard was still there
            busy.get(timeout=60)
            client = tensor_client(pm)

            def only_x_left() -> bool:
                client.flush()
                return [v["refs"] for v in client.backend.stats(client.seq).get(timeout=60).values()] == [1, 1]

            wait_for(only_x_left, timeout=30)  # and once answered, it was deleted


def test_a_module_trains_on_every_rank(procs):
    with procs.activate():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 4)
        y = x.sum(1, keepdim=True)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
    assert isinstance(model.weight, Tensor) and model.weight.requires_grad
    assert isinstance(model.weight.grad, Tensor) and model.weight.grad.shape == (1, 4)
    for rank in (0, 3):
        values = [float(inspect(v, gpus=rank)) for v in losses]
        assert values[-1] < values[0], values
    torch.testing.assert_close(inspect(model.weight.grad, gpus=2).shape, torch.Size([1, 4]))


def test_grad_generator_and_borrows_on_a_stream(procs):
    comms = mk.Stream("comms")
    with procs.activate():
        model = torch.nn.Linear(3, 2)
        loss = model(torch.ones(4, 3)).sum()
        params = list(model.parameters())
        grads = []
        for g in mk.grad_generator(loss, params):
            g_c, borrow = comms.borrow(g, mutable=True)
            with comms.activate():
                assert mk.get_active_stream() is comms
                grads.append(g_c * 1)
            borrow.drop()
    assert [g.shape for g in grads] == [(2, 3), (2,)]
    assert inspect(grads[0], gpus=1).tolist() == [[4.0] * 3] * 2 and inspect(grads[1]).tolist() == [4.0, 4.0]


def test_remote_functions_send_and_fetch(procs):
    with procs.activate():
        d = doubled(torch.ones(2))
        pids = pid.call().get(timeout=60)
        port, receiver = Channel.open()
        send(pid, port=port)
    assert isinstance(d, Tensor) and inspect(d, gpus=3).tolist() == [2.0, 2.0]
    assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()
    assert sorted(receiver.recv().get(timeout=60) for _ in range(4)) == sorted(pids.values())
    assert call_on_shard_and_fetch(doubled, d, shard={"gpus": 1}).get(timeout=60).tolist() == [4.0, 4.0]


def test_actors_see_their_ranks_shard_and_make_distributed_results(procs):
    linear = procs.spawn("linear", Linear)
    with procs.activate():
        r = procs.rank_tensor("gpus").float() + 10
        t = torch.ones(3, 3)
        o = torch.relu(linear.forward.rref(t)) + 1
    assert list(linear.total.call(r).get(timeout=60).values()) == [10.0, 11.0, 12.0, 13.0]
    with this_host().spawn_procs(per_host={"gpus": 1}) as other:
        elsewhere = other.spawn("linear", Linear)
        with pytest.raises(TypeError, match="passed to actors on other procs"):
            elsewhere.total.call(r)
    assert o.shape == (3, 3) and inspect(o, gpus=2).tolist() == [[3.0] * 3] * 3


def test_a_slice_computes_on_its_ranks_only(procs):
    half = procs.slice(gpus=slice(2, 4))
    with half.activate():
        t = half.rank_tensor("gpus") + 100
    assert t.mesh.extent == {"gpus": 2}
    assert [int(inspect(t, gpus=i)) for i in range(2)] == [100, 101]
    with procs.activate():
        u = t + 1  # on t's mesh, as in Monarch, whichever mesh is active
    assert u.mesh.extent == {"gpus": 2} and [int(inspect(u, gpus=i)) for i in range(2)] == [101, 102]
    half_only = mk.slice_mesh(t, gpus=1)
    assert int(inspect(half_only)) == 101


def test_reductions_over_mesh_dims_and_moves_between_slices(procs):
    with procs.activate():
        r = procs.rank_tensor("gpus").float() + torch.zeros(2)  # rank i holds [i, i]
        total = r.reduce("gpus", "sum")
        top = r.reduce("gpus", "max")
        stacked = r.reduce("gpus", "stack")
        mean = r.reduce(None, "avg")
        with pytest.raises(ValueError, match="no dimension 'hosts'"):
            r.reduce("hosts")
        inplace = r.clone()
        inplace.reduce_("gpus", "product")
    assert total.shape == (2,) and stacked.shape == (4, 2)
    assert [inspect(total, gpus=g).tolist() for g in range(4)] == [[6.0, 6.0]] * 4
    assert inspect(top, gpus=2).tolist() == [3.0, 3.0] and inspect(mean).tolist() == [1.5, 1.5]
    assert inspect(stacked, gpus=1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert inspect(inplace, gpus=3).tolist() == [0.0, 0.0]
    grid = procs.split(gpus=("a", "b"), b=2)  # 2 x 2
    with grid.activate():
        a = grid.rank_tensor("a").float() * 10 + grid.rank_tensor("b").float()  # 0, 1, 10, 11
        over_b = a.reduce("b", "sum")
        over_a = a.reduce("a", "sum")
        over_both = a.reduce(("a", "b"), "sum")
    assert [float(inspect(over_b, a=i, b=0)) for i in range(2)] == [1.0, 21.0]
    assert [float(inspect(over_a, a=0, b=j)) for j in range(2)] == [10.0, 12.0]
    assert float(inspect(over_both, a=1, b=1)) == 22.0
    first, second = procs.slice(gpus=slice(0, 2)), procs.slice(gpus=slice(2, 4))
    with first.activate():
        x = first.rank_tensor("gpus").float() + 7  # 7, 8 on ranks 0-1
    moved = mk.to_mesh(x, second)
    with second.activate():
        y = moved * 2
    assert [float(inspect(y, gpus=i)) for i in range(2)] == [14.0, 16.0]


def test_streams_run_at_the_same_time_on_each_rank(procs):
    comms = mk.Stream("gate")
    with procs.activate():
        with comms.activate():
            waited = wait_for_gate()  # on the comms stream's thread: waits for the main stream
        opened = open_gate()  # recorded after it, on the main stream
        with comms.activate():
            assert waited._stream is comms and mk.get_active_stream() is comms
    assert [float(inspect(waited, gpus=g)) for g in range(4)] == [1.0] * 4  # 0.0: the streams ran one by one
    assert float(inspect(opened)) == 1.0


def test_borrows_order_streams_and_their_rules_are_checked_at_once(procs):
    comms = mk.Stream("comms")
    with procs.activate():
        t = torch.ones(2)
        with comms.activate(), pytest.raises(RuntimeError, match="a tensor of the main stream used on stream 'comms'"):
            t + 1
        t_c, borrow = comms.borrow(t, mutable=True)
        with pytest.raises(RuntimeError, match="borrowed mutably by stream 'comms'"):
            t + 1
        with comms.activate():
            t_c.mul_(5)  # the main stream sees it after the drop
            t_c.reduce_("gpus", "sum")
        borrow.drop()
        seen = t + 1
        with comms.activate(), pytest.raises(RuntimeError, match="after borrow.drop"):
            t_c + 1
        r_c, read_only = comms.borrow(t)
        with comms.activate(), pytest.raises(RuntimeError, match="writes to a tensor borrowed read-only"):
            r_c.add_(1)
        with pytest.raises(RuntimeError, match="writes to a tensor borrowed read-only"):
            t.add_(1)
        with comms.activate():
            doubled = r_c * 2
        read_only.drop()
        t.add_(1)  # writable again
    assert inspect(seen, gpus=2).tolist() == [21.0, 21.0]
    assert inspect(doubled).tolist() == [40.0, 40.0] and inspect(t).tolist() == [21.0, 21.0]


def test_grad_generator_runs_the_backward_only_as_far_as_asked(procs):
    comms = mk.Stream("probe")
    with procs.activate():
        first = torch.nn.Linear(3, 3)
        last = torch.nn.Linear(3, 1)
        x = torch.ones(2, 3)
        loss = last(traced(first(x))).sum()
        params = [last.weight, last.bias, first.weight, first.bias]
        grads, seen = [], []
        for g in mk.grad_generator(loss, params):
            g_c, borrow = comms.borrow(g)
            with comms.activate():
                seen.append(backward_passes())  # before the next gradient: only what this one needed ran
            borrow.drop()
            grads.append(g)
        expected_h = first(x)
    assert [int(inspect(s, gpus=1)) for s in seen] == [0, 0, 1, 1]
    w = inspect(last.weight)
    torch.testing.assert_close(inspect(grads[0]), inspect(expected_h).sum(0, keepdim=True))
    torch.testing.assert_close(inspect(grads[3]), 3 * 2 * w[0])  # through traced's own backward (x3)


@pytest.mark.timeout(60)
def test_a_rank_whose_reduce_input_failed_takes_part_so_its_peers_fail_at_once(procs):
    with procs.activate():
        i = procs.rank_tensor("gpus")
        bad = torch.zeros(3)[i.reshape(1)]  # out of bounds on rank 3 only
        total = bad.reduce("gpus", "sum")
        in_place = bad.clone()
        in_place.reduce_("gpus", "max")
        after = (i.float() + 1).reduce("gpus", "sum")  # the group goes on working
    for g in (0, 3):
        with pytest.raises(RemoteException, match="failed on rank 3"):
            inspect(total, gpus=g)
    with pytest.raises(RemoteException, match="failed on rank 3"):
        inspect(in_place, gpus=1)
    assert float(inspect(after, gpus=2)) == 10.0


@pytest.mark.timeout(150)
def test_a_rank_that_dies_raises_process_died_at_the_next_fetch():
    with this_host().spawn_procs(per_host={"gpus": 2}) as pm:
        with pm.activate():
            t = pm.rank_tensor("gpus")
        with pm.activate():
            ranks_pids = pid.call().get(timeout=60)
        assert int(inspect(t, gpus=1)) == 1
        os.kill(ranks_pids[{"gpus": 1}], signal.SIGKILL)
        with pytest.raises(ProcessDied):
            fetch_shard(t, gpus=1).get(timeout=60)
        assert int(inspect(t, gpus=0)) == 0  # the other rank goes on


@pytest.mark.timeout(60)
def test_a_move_whose_source_failed_fails_its_destination_at_once(procs):
    first, second = procs.slice(gpus=slice(0, 2)), procs.slice(gpus=slice(2, 4))
    with first.activate():
        i = first.rank_tensor("gpus")
        bad = torch.zeros(3)[i.reshape(1) * 5]  # out of bounds on gpus=1 only
    moved = mk.to_mesh(bad, second)
    with second.activate():
        doubled = moved * 2
    assert float(inspect(doubled, gpus=0)) == 0.0  # rank 0's input was fine
    with pytest.raises(RemoteException, match="failed on rank 1"):
        inspect(moved, gpus=1)
    with pytest.raises(RemoteException, match="failed on rank 1"):
        inspect(doubled, gpus=1)
    with first.activate():
        again = first.rank_tensor("gpus").float() + 1
    assert [float(inspect(mk.to_mesh(again, second), gpus=g)) for g in range(2)] == [1.0, 2.0]  # and it goes on


def _messages_read() -> int:
    from monarch_kernel.runtime.process import Runtime

    return Runtime.current().stats()["received"]


def test_a_fetch_after_ops_reaches_its_rank_as_one_message():
    with this_host().spawn_procs(per_host={"gpus": 2}) as pm:
        with pm.activate():
            x = torch.zeros(2)
        with pm.activate():
            before = call_on_shard_and_fetch(_messages_read, shard={"gpus": 1}).get(timeout=60)
        for i in range(20):
            with pm.activate():
                x = x + 1
            assert inspect(x, gpus=1).tolist() == [i + 1.0, i + 1.0]
        with pm.activate():
            after = call_on_shard_and_fetch(_messages_read, shard={"gpus": 1}).get(timeout=60)
        # 20 fetches and the count's own: the ops rode with the fetches (apart, 41)
        assert after - before < 30, after - before
        assert inspect(x, gpus=0).tolist() == [20.0, 20.0]  # and rank 0 ran them, told
