"""W10: the DDP notebook's model (an MLP on 2-D spirals, 4 ranks, gloo) as one unmodified
torchrun script, run (a) on warm ranks through the mesh (``SPMDActor.main``) and (b) under
``torchrun --nproc-per-node 4``, in this one run:

- step time: median over ranks of each rank's median step (after 20 warm-up steps), ms;
- edit-and-rerun: from starting a second run of the script to its first completed step on
  warm ranks, against from starting a fresh torchrun to its first step, s;
- peak RSS per rank (``ru_maxrss``), DDP against FSDP2, each on fresh ranks: the notebook's
  model, and the FSDP notebook's wider one (4 x 1024^2), MiB;
- recovery: from a rank's SIGKILL during DDP training to the first step completed after
  ``restart`` + ``setup_torch_distributed`` + ``PeerCheckpoint.restore``, s (with its parts).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from monarch_kernel import Actor, endpoint

from ._util import log

N = 4
STEPS = 220
WARMUP = 20

SCRIPT = r'''
import argparse, json, os, resource, statistics, time
import torch, torch.distributed as dist
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=220)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--out", required=True)
p.add_argument("--fsdp", action="store_true")
p.add_argument("--width", type=int, default=64)
p.add_argument("--depth", type=int, default=2)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def spirals(n, seed):
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for arm in range(3):
        r = torch.rand(n, generator=g) * 0.95 + 0.05
        t = 4.0 * r + arm * 2.0944 + 0.2 * torch.randn(n, generator=g)
        xs.append(torch.stack([r * torch.sin(t), r * torch.cos(t)], dim=1))
        ys.append(torch.full((n,), arm))
    return torch.cat(xs), torch.cat(ys)


X, Y = spirals(1000, 0)
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
torch.manual_seed(0)
layers = [torch.nn.Linear(2, a.width), torch.nn.ReLU()]
for _ in range(a.depth - 1):
    layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 3))
if a.fsdp:
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    wrapped = fully_shard(model)
else:
    from torch.nn.parallel import DistributedDataParallel as DDP
    wrapped = DDP(model)
opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
times, first_step_at = [], None
for step in range(a.steps):
    t0 = time.perf_counter()
    idx = torch.randint(0, len(X), (64,), generator=torch.Generator().manual_seed(step * world + rank))
    loss = F.cross_entropy(wrapped(X[idx]), Y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
    if first_step_at is None:
        first_step_at = time.time()
with open(os.path.join(a.out, f"{rank}.json"), "w") as f:
    json.dump({"step_ms": statistics.median(times[a.warmup:]) * 1e3 if len(times) > a.warmup else None,
               "first_step_at": first_step_at, "loss": loss.item(),
               "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "rss_before_model_mib": rss_before}, f)
dist.destroy_process_group()
'''


def _results(out: str) -> list[dict]:
    rows = []
    for r in range(N):
        with open(os.path.join(out, f"{r}.json")) as f:
            rows.append(json.load(f))
    return rows


def _mesh_run(procs, spmd, script, args, tmp, tag) -> tuple[list[dict], float]:
    """One run through the mesh, as ``%mesh run`` does it: a fresh rendezvous port, then
    ``SPMDActor.main`` (timed from the set-up: it is part of starting a run)."""
    from monarch_kernel.spmd import setup_torch_elastic_env

    out = os.path.join(tmp, tag)
    os.makedirs(out)
    started = time.time()
    addr, port = setup_torch_elastic_env(procs)
    spmd.main.call(addr, port, [script, "--out", out, *args]).get(timeout=300)
    return _results(out), started


def _torchrun(script, args, tmp, tag) -> tuple[list[dict], float]:
    out = os.path.join(tmp, tag)
    os.makedirs(out)
    started = time.time()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(N), script,
                        "--out", out, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"torchrun exited with {p.returncode}: {p.stderr[-2000:]}")
    return _results(out), started


def _step_ms(rows) -> float:
    return round(statistics.median(r["step_ms"] for r in rows), 3)


def _rss(rows) -> dict:
    return {"max": round(max(r["rss_mib"] for r in rows), 1),
            "mean": round(statistics.mean(r["rss_mib"] for r in rows), 1),
            "before_model_mean": round(statistics.mean(r["rss_before_model_mib"] for r in rows), 1)}


class Trainer(Actor):
    """DDP with PeerCheckpoint; rank 0 writes its last step to ``progress``."""

    @endpoint
    def train(self, steps: int, progress: str) -> dict:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        from monarch_kernel.spmd import PeerCheckpoint

        t_enter = time.time()
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ckpt = PeerCheckpoint.get("w10")
        start = ckpt.restore(model, opt)
        t_restored = time.time()
        ddp = DDP(model)
        first = None
        for step in range(start, steps):
            x = torch.randn(64, 2, generator=torch.Generator().manual_seed(step * world + rank))
            loss = F.cross_entropy(ddp(x), (x[:, 0] > 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.save(step + 1, model, opt)
            first = first or time.time()
            if rank == 0 and step % 5 == 0:
                with open(progress + ".tmp", "w") as f:
                    f.write(str(step + 1))
                os.replace(progress + ".tmp", progress)
        return {"start": start, "from": ckpt.restored_from, "enter": t_enter, "restored": t_restored,
                "first_step_at": first}


def w10() -> dict:
    from monarch_kernel import this_host
    from monarch_kernel.spmd import SPMDActor

    tmp = tempfile.mkdtemp(prefix="mk-w10-")
    script = os.path.join(tmp, "train_ddp.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    args = ["--steps", str(STEPS), "--warmup", str(WARMUP)]
    out: dict = {}
    procs = this_host().spawn_procs(per_host={"gpus": N})
    try:
        spmd = procs.spawn("spmd", SPMDActor)
        cold, cold_start = _mesh_run(procs, spmd, script, args, tmp, "mesh-cold")
        warm, warm_start = _mesh_run(procs, spmd, script, args, tmp, "mesh-warm")
        fresh, fresh_start = _torchrun(script, args, tmp, "torchrun")
        mesh_ms, torchrun_ms = _step_ms(warm), _step_ms(fresh)
        out["W10_step_ms"] = {"mesh": mesh_ms, "torchrun": torchrun_ms, "ratio": round(mesh_ms / torchrun_ms, 3),
                              "target_ratio": 1.05, "mesh_first_run": _step_ms(cold)}
        out["W10_rerun_to_first_step_s"] = {
            "mesh_warm": round(max(r["first_step_at"] for r in warm) - warm_start, 3),
            "torchrun_fresh": round(max(r["first_step_at"] for r in fresh) - fresh_start, 3),
            "mesh_first_run": round(max(r["first_step_at"] for r in cold) - cold_start, 3)}
        log(f"W10 step/rerun: {out}")
        out["W10_recovery_s"] = _recover(procs, tmp)
        log(f"W10 recovery: {out['W10_recovery_s']}")
    finally:
        procs.stop().get(timeout=60)
    rss: dict = {}
    for model, extra in (("notebook_mlp", []), ("wide_4x1024", ["--width", "1024", "--depth", "4"])):
        for kind in ("ddp", "fsdp2"):
            with this_host().spawn_procs(per_host={"gpus": N}) as fresh_procs:
                spmd = fresh_procs.spawn("spmd", SPMDActor)
                rows, _ = _mesh_run(fresh_procs, spmd, script, ["--steps", "30", "--warmup", "5", *extra]
                                    + (["--fsdp"] if kind == "fsdp2" else []), tmp, f"rss-{model}-{kind}")
            rss.setdefault(model, {})[kind] = _rss(rows)
        d, f = rss[model]["ddp"]["mean"], rss[model]["fsdp2"]["mean"]
        rss[model]["fsdp2_saves_pct"] = round(100 * (d - f) / d, 1)
    out["W10_peak_rss_mib"] = rss
    log(f"W10 rss: {rss}")
    return out


def _recover(procs, tmp) -> dict:
    """A rank's SIGKILL mid-training to the first step after resuming, and its parts."""
    from monarch_kernel import ActorError
    from monarch_kernel.spmd import setup_torch_distributed

    setup_torch_distributed(procs)
    trainer = procs.spawn("w10trainer", Trainer)
    progress = os.path.join(tmp, "progress")
    fut = trainer.train.call(100000, progress)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with open(progress) as f:
                if int(f.read() or 0) >= 50:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    victim = procs.rank_states()[2]["pid"]
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    try:
        fut.get(timeout=120)
    except ActorError:
        pass
    t_failed = time.time()
    procs.restart([2], [(trainer, Trainer, (), {})])
    t_restarted = time.time()
    setup_torch_distributed(procs)
    t_group = time.time()
    with open(progress) as f:
        reached = int(f.read() or 0)
    runs = list(trainer.train.call(reached + 40, progress).get(timeout=120).values())
    first = max(r["first_step_at"] for r in runs)
    restored = max(r["restored"] for r in runs)
    return {"total": round(first - t_kill, 3), "death_to_survivors_failed": round(t_failed - t_kill, 3),
            "restart_rank": round(t_restarted - t_failed, 3), "rebuild_group": round(t_group - t_restarted, 3),
            "restore_via_rdma": round(restored - min(r["enter"] for r in runs), 3),
            "resumed_at_step": runs[0]["start"], "pulled_from_rank": runs[2]["from"]}
