"""W10elastic's training function, run on the ranks by ``elastic_run``: the DDP notebook's
MLP on 2-D spirals; rank 0 appends ``step world time`` to a file after each step."""

from __future__ import annotations

import time


def spirals(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for arm in range(3):
        r = torch.rand(n, generator=g) * 0.95 + 0.05
        t = 4.0 * r + arm * 2.0944 + 0.2 * torch.randn(n, generator=g)
        xs.append(torch.stack([r * torch.sin(t), r * torch.cos(t)], dim=1))
        ys.append(torch.full((n,), arm))
    return torch.cat(xs), torch.cat(ys)


def train(steps: int, progress: str, name: str, batch: int = 64, plain: bool = False) -> float:
    """``plain``: the same loop over ``range(steps)``, without ``elastic_steps`` (no restore,
    no resize agreement, nothing kept): the base its per-step cost is measured against."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from monarch_kernel.spmd import elastic_steps

    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y = spirals(1000, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ddp = DDP(model)
    loss = torch.zeros(())
    for step in range(steps) if plain else elastic_steps(steps, model, opt, name=name):
        g = torch.Generator().manual_seed(step * world + rank)
        idx = torch.randint(0, len(X), (batch,), generator=g)
        loss = F.cross_entropy(ddp(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"{step + 1} {world} {time.time()}\n")
        time.sleep(0.01)  # a step of about the notebook's, so that a death lands mid-training
    return loss.item()
