"""torch.distributed on a mesh (monarch_kernel.spmd), through the API: torchrun's variables,
the process group and the device mesh on real ranks, Monarch's SPMDActor running a torchrun
script, PeerCheckpoint, and DDP training that survives a rank's SIGKILL (the survivors' group
is cut at once, the replaced rank pulls the state from a survivor through RDMABuffer, step
numbers go on).  One 2x2 mesh for the module (torch is imported on its ranks once); the
recovery test, last, stops it, since it replaces a rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support.gpus import default_backend, devices_here

from monarch_kernel import Actor, ActorError, ProcessDied, endpoint, this_host
from monarch_kernel.spmd import (
    PeerCheckpoint,
    RankEnv,
    ScriptExit,
    SPMDActor,
    device_mesh,
    setup_torch_distributed,
    setup_torch_elastic_env,
)
from monarch_kernel.spmd.layout import elastic_layout, layout_from_point

pytestmark = pytest.mark.timeout(240)

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
       "MASTER_PORT", "OMP_NUM_THREADS")


class Probe(Actor):
    @endpoint
    def env(self) -> dict:
        return {k: os.environ.get(k) for k in ENV}

    @endpoint
    def all_reduce(self) -> tuple:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return dist.get_rank(), dist.get_world_size(), t.item()

    @endpoint
    def coordinate(self) -> tuple:
        from monarch_kernel.spmd import current_device_mesh

        mesh = current_device_mesh()
        return tuple(mesh.get_coordinate()), tuple(mesh.mesh_dim_names), tuple(mesh.shape)

    @endpoint
    def has_group(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized()

    @endpoint
    def drop_group(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def abort_then_reduce(self, absent: int) -> tuple:
        """A group made as a cell makes one (``init_process_group`` from torchrun's variables,
        its connections unknown to the abort), aborted as the watchdog does; then what a main
        thread let go of a SIGSTOP does: it posts the collective it was about to post, on the
        group it held, which rank ``absent`` never joins.  How that collective ended."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from monarch_kernel.spmd.rank import group

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo")
        me, held = dist.get_rank(), dist.distributed_c10d._get_default_group()  # noqa: SLF001
        group.abort_group("the test aborts it")
        if me == absent:
            self.kept = held  # its connections stay up (a stopped rank's would)
            return "absent", dist.is_initialized()
        try:
            held.allreduce([torch.ones(1)]).wait(timedelta(seconds=30))
            ended = "it reduced"
        except RuntimeError as e:
            ended = str(e)
        return ended, dist.is_initialized()


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"dp": 2, "tp": 2})
    yield procs
    procs.stop().get(timeout=30)


@pytest.fixture(scope="module")
def probe(procs):
    return procs.spawn("probe", Probe)


# ---------------------------------------------------------------- without ranks


def test_local_ranks_count_within_each_host():
    lay = elastic_layout([0, 1, 2, 3], ["a", "a", "b", "b"])
    assert [lay[r] for r in range(4)] == [RankEnv(0, 4, 0, 2, 0, 2), RankEnv(1, 4, 1, 2, 0, 2),
                                          RankEnv(2, 4, 0, 2, 1, 2), RankEnv(3, 4, 1, 2, 1, 2)]
    # a slice: its first rank is RANK 0, whatever its number in the proc mesh
    lay = elastic_layout([2, 3], ["h", "h"])
    assert (lay[2].rank, lay[3].rank, lay[3].world_size, lay[3].local_world_size) == (0, 1, 2, 2)
    v = lay[3].variables("10.0.0.1", 29500)
    assert (v["RANK"], v["LOCAL_RANK"], v["MASTER_ADDR"], v["MASTER_PORT"], v["ROLE_WORLD_SIZE"]) == (
        "1", "1", "10.0.0.1", "29500", "2")


def test_an_spmd_actor_without_a_layout_follows_monarchs_rule():
    # {"hosts": 2, "gpus": 4}: the last dim is one host's ranks
    assert layout_from_point((1, 2), (2, 4)) == RankEnv(6, 8, 2, 4, 1, 2)
    assert layout_from_point((), ()) == RankEnv(0, 1, 0, 1, 0, 1)


def test_importing_spmd_imports_no_torch():
    code = "import sys, monarch_kernel.spmd, monarch_kernel.kernel.magics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_peer_checkpoint_in_one_process():
    import torch

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = PeerCheckpoint("one-process")
    assert ckpt.restore(model, opt) == 0 and ckpt.step is None
    for step in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        ckpt.save(step + 1, model, opt)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    adam_step = opt.state_dict()["state"][0]["step"].item()
    with torch.no_grad():
        model.weight.add_(1.0)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    assert ckpt.steps() == [3, 2]
    assert ckpt.restore(model, fresh) == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    assert fresh.state_dict()["state"][0]["step"].item() == adam_step
    with pytest.raises(TypeError, match="restore got 1 objects but 2 were saved"):
        ckpt.restore(model)
    with pytest.raises(ValueError, match="number of completed steps"):
        ckpt.save(-1, model)
    assert PeerCheckpoint.get("shared") is PeerCheckpoint.get("shared")


LATE_INTERRUPT = """
import socket, sys
import torch.distributed as dist
from monarch_kernel.spmd.rank import script

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def write(name, body):
    path = f"{sys.argv[1]}/{name}"
    with open(path, "w") as f:
        f.write(body)
    return path

init = 'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{}", world_size=1, rank=0)'
failing = write("fails.py", f"import torch.distributed as dist\\n{init.format(free_port())}\\n"
                "raise ValueError('bad batch')")
good = write("good.py", f"import torch, torch.distributed as dist\\n{init.format(free_port())}\\n"
             "t = torch.ones(2)\\ndist.all_reduce(t)\\ndist.destroy_process_group()")
where, landed = sys.argv[2], []  # (run_script sets sys.argv while the script runs)
def late_interrupt(frame, event, arg):  # the stop button's interrupt, landing in the cleanup (once:
    if event == "call" and frame.f_code.co_qualname == where:  # an error unsets the trace function)
        landed.append(where)
        raise KeyboardInterrupt
    return None
sys.settrace(late_interrupt)
try:
    script.run_script([failing])
except BaseException as e:
    raised = type(e).__name__
sys.settrace(None)
print(raised, landed == [where], dist.is_initialized(), dist.init_process_group.__qualname__, script.run_script([good]))
"""


@pytest.mark.parametrize("where", ["_abort_process_group", "_GroupGuard.remove"])
def test_a_late_interrupt_in_a_failed_scripts_cleanup_leaves_the_next_run_a_clean_rank(tmp_path, where):
    # The stop button interrupts every rank; a rank whose script already failed (its peer's
    # abort cut its collective short) gets its interrupt in the cleanup.  A group left half
    # aborted there was taken as live by the next run, which skipped the rendezvous its peer
    # then waited in for good (found by tests/stress.sh under load).
    out = subprocess.run([sys.executable, "-c", LATE_INTERRUPT, str(tmp_path), where], capture_output=True,
                         text=True, timeout=120)
    # The script's own error; the interrupt landed; no group left; torch's init again; a new run works.
    assert out.stdout.split() == ["ValueError", "True", "False", "init_process_group", "True"], out.stdout + out.stderr


# ---------------------------------------------------------------- on a 2x2 mesh


def test_setup_torch_distributed_gives_torchrun_variables_and_a_group(procs, probe):
    # None: nccl only where every rank has a GPU of its own (gloo here, and where 4 ranks share fewer)
    assert setup_torch_distributed(procs) == default_backend(4)
    envs = list(probe.env.call().get(timeout=60).values())
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]  # one host
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs} == {
        ("4", "4", "0", "1")}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}  # torchrun's default for several ranks per host
    assert sorted(probe.all_reduce.call().get(timeout=60).values()) == [(r, 4, 6.0) for r in range(4)]
    # again: the group is rebuilt over the same ranks
    assert setup_torch_distributed(procs, "gloo") == "gloo"
    assert sorted(probe.all_reduce.call().get(timeout=60).values()) == [(r, 4, 6.0) for r in range(4)]


def test_backends_that_cannot_work_say_why(procs):
    if devices_here() == 0:
        with pytest.raises(RuntimeError, match=r"backend='nccl' needs a GPU on every rank, and ranks \[0, 1, 2, 3\]"):
            setup_torch_distributed(procs, "nccl")
    elif devices_here() < 4:  # four ranks on fewer GPUs: NCCL would refuse them ("Duplicate GPU detected")
        with pytest.raises(RuntimeError, match=r"backend='nccl' needs a GPU of its own per rank, and ranks \[0, "
                           r".*share one .*use backend='gloo'"):
            setup_torch_distributed(procs, "nccl")
    with pytest.raises(ValueError, match="choose 'gloo', 'nccl', or None"):
        setup_torch_distributed(procs, "mpi")


def test_nccl_where_every_rank_has_a_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA GPUs (there are none here): the nccl path runs only where every rank has one")
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        assert setup_torch_distributed(procs) == "nccl"


def test_device_mesh_takes_the_proc_meshs_dims(procs, probe):
    handle = device_mesh(procs, ("dp", "tp"))
    device = "cuda" if default_backend(4) == "nccl" else "cpu"
    # (the name depends on test order)
    assert repr(handle) == f"DeviceMesh<{{'dp': 2, 'tp': 2}} {device} on '{procs.name}'>"
    got = probe.coordinate.call().get(timeout=60)
    for point, (coord, names, shape) in got.items():
        assert coord == (point["dp"], point["tp"]) and names == ("dp", "tp") and shape == (2, 2)
    with pytest.raises(ValueError, match=r"has dims \{'dp': 2, 'tp': 2\}, so device_mesh needs 2 names, not 3"):
        device_mesh(procs, ("a", "b", "c"))
    with pytest.raises(ValueError, match=r"mesh_shape=\(3,\) holds 3 ranks"):
        device_mesh(procs, ("x",), mesh_shape=(3,))
    device_mesh(procs, ("x",), mesh_shape=(4,))
    assert sorted(c for c, _n, _s in probe.coordinate.call().get(timeout=60).values()) == [(0,), (1,), (2,), (3,)]


def test_a_slice_gets_its_own_ranks(procs, probe):
    addr, _port = setup_torch_elastic_env(procs.slice(dp=1))
    assert addr == "127.0.0.1"
    envs = [e for e in probe.slice(dp=1).env.call().get(timeout=60).values()]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"]) for e in envs] == [("0", "2", "0"), ("1", "2", "1")]


def test_a_collective_posted_on_an_aborted_gloo_group_ends_in_seconds_and_a_group_is_made_again(procs, probe):
    # The hang watchdog's abort shuts the connections of the groups it knows (those made by
    # setup_torch_distributed, device_mesh, a script), which ends what waits on them.  A
    # collective posted after the abort (a main thread let go of a SIGSTOP races the abort, and
    # may also post just as the shut lands and miss it: fresh29) waited out the group's timeout
    # (30 minutes), the mesh with it; now it gets one second.  Here rank 3 keeps the group's
    # connections up (as a stopped rank does), and the group is made as a cell makes one, so
    # the abort knows none of its connections: only the short timeout can end it.
    setup_torch_elastic_env(procs)
    for point, (ended, has_group) in probe.abort_then_reduce.call(3).get(timeout=60).items():
        assert not has_group, point
        if point.rank != 3:  # ended by the short timeout, or by rank 3's abort; not by the wait's (30 s)
            assert "Operation timed out" not in ended and ended != "it reduced", (point, ended)
    assert setup_torch_distributed(procs, "gloo") == "gloo"
    assert sorted(probe.all_reduce.call().get(timeout=60).values()) == [(r, 4, 6.0) for r in range(4)]


def test_spmd_actor_runs_an_unmodified_torchrun_script(procs, probe, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import argparse, os, sys
        import torch, torch.distributed as dist
        p = argparse.ArgumentParser()
        p.add_argument("--out")
        p.add_argument("--exit", type=int, default=0)
        a = p.parse_args()
        dist.init_process_group("gloo")
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        with open(os.path.join(a.out, os.environ["RANK"]), "w") as f:
            f.write(f"{dist.get_world_size()} {t.item()} {os.environ['LOCAL_RANK']} {sys.argv[0]}")
        dist.destroy_process_group()
        if a.exit:
            sys.exit(a.exit)
    """))
    setup_torch_distributed(procs)
    spmd = procs.spawn("spmd", SPMDActor)
    addr, port = spmd.slice(dp=0, tp=0).get_host_port.call_one(None).get(timeout=60)
    out = tmp_path / "with-group"
    out.mkdir()
    # The ranks have a group: the script's init_process_group is a no-op, its destroy keeps it.
    assert list(spmd.main.call(addr, port, [str(script), "--out", str(out)]).get(timeout=120).values()) == [True] * 4
    assert sorted(os.listdir(out)) == ["0", "1", "2", "3"]
    assert (out / "3").read_text() == f"4 6.0 3 {script}"
    assert list(probe.has_group.call().get(timeout=60).values()) == [True] * 4
    # Without a group the script makes its own (env://) and destroys it.
    probe.drop_group.call().get(timeout=60)
    out = tmp_path / "without"
    out.mkdir()
    assert all(spmd.main.call(addr, port, [str(script), "--out", str(out)]).get(timeout=120).values())
    assert (out / "0").read_text().startswith("4 6.0 0")
    assert list(probe.has_group.call().get(timeout=60).values()) == [False] * 4
    # -m MODULE, and sys.exit(0) is success; another status is the rank's error.
    assert all(spmd.main.call(addr, port, ["-m", "json.tool", "--help"]).get(timeout=60).values())
    with pytest.raises(ActorError) as info:
        spmd.main.call(addr, port, [str(script), "--out", str(out), "--exit", "3"]).get(timeout=120)
    assert isinstance(info.value.__cause__, ScriptExit) and "exited with status 3" in str(info.value.__cause__)


# ---------------------------------------------------------------- surviving a rank's death


class Trainer(Actor):
    """DDP on a small MLP with PeerCheckpoint; rank 0 writes its step to ``progress``."""

    @endpoint
    def train(self, steps: int, progress: str) -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ckpt = PeerCheckpoint.get("test")
        start = ckpt.restore(model, opt)
        first_step_at = None
        ddp = DDP(model)
        teacher = torch.randn(8, 2, generator=torch.Generator().manual_seed(5))
        losses = []
        for step in range(start, steps):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step * world + rank))
            loss = F.cross_entropy(ddp(x), (x @ teacher).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.save(step + 1, model, opt)
            if first_step_at is None:
                first_step_at = time.time()
            losses.append((step + 1, loss.item()))
            if rank == 0:
                with open(progress + ".tmp", "w") as f:
                    f.write(str(step + 1))
                os.replace(progress + ".tmp", progress)
        return {"start": start, "from": ckpt.restored_from, "losses": losses, "first_step_at": first_step_at}


def _wait_for_step(progress, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(progress) as f:
                if int(f.read() or 0) >= step:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for rank 0 to reach step {step}")


def test_a_killed_rank_is_replaced_and_pulls_the_state_from_a_survivor(procs, tmp_path):
    try:
        setup_torch_distributed(procs)
        trainer = procs.spawn("trainer", Trainer)
        progress = str(tmp_path / "step")
        first = trainer.train.call(400, progress)
        _wait_for_step(progress, 40)
        victim = procs.rank_states()[2]["pid"]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ActorError) as info:
            first.get(timeout=60)
        failed_after = time.monotonic() - killed_at
        results = list(info.value.results.values())
        assert isinstance(results[2], ProcessDied) and "killed by signal 9 (SIGKILL)" in str(results[2])
        for r in (0, 1, 3):  # the survivors' collectives fail at once, not at gloo's timeout
            assert isinstance(results[r], ActorError) and "Connection" in str(results[r].__cause__), results[r]
        assert failed_after < 15, f"the survivors took {failed_after:.1f} s to fail"

        procs.restart([2], [(trainer, Trainer, (), {})])
        assert setup_torch_distributed(procs) == default_backend(4)
        done = trainer.train.call(80 + 40, progress).get(timeout=120)
        runs = list(done.values())
        start = runs[0]["start"]
        # Rank 0 wrote step 40 once its step was done; a survivor whose step-40 all-reduce was
        # cut by the death holds step 39, which every rank can reach: one step repeated at most.
        assert start >= 39 and {r["start"] for r in runs} == {start}
        assert [r["from"] for r in runs[:2] + runs[3:]] == [None, None, None]  # survivors: their own memory
        assert runs[2]["from"] in (0, 1, 3)  # the new rank: a survivor's, through RDMABuffer
        steps = [s for s, _ in runs[2]["losses"]]
        assert steps == list(range(start + 1, 121))  # continuous
        losses = [v for _, v in runs[0]["losses"]]
        assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10  # still falling
    finally:
        procs.stop().get(timeout=30)  # its replaced rank is this test's: it must end with it
