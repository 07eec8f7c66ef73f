"""Which torchrun variables each rank of a mesh gets: ``RANK``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` per host, ``GROUP_RANK`` (the host's index), ``WORLD_SIZE``...

Pure functions over rank numbers and host names, computed by the controller and handed to
the ranks; nothing here imports torch or touches a process's environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..runtime import counted


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in a torch.distributed world, as torchrun would describe it.

    Example::

        %%mesh
        import os
        print(os.environ["RANK"], os.environ["LOCAL_RANK"])   # as RankEnv set them
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the index of this rank's host, in the order hosts first appear
    group_world_size: int  # how many hosts

    def variables(self, master_addr: str, master_port: int) -> dict[str, str]:
        """torchrun's environment variables for this rank (its documented set)."""
        return {
            "MASTER_ADDR": str(master_addr), "MASTER_PORT": str(int(master_port)),
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank), "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_RANK": str(self.rank), "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
            "TORCHELASTIC_RUN_ID": "monarch",
            # RANK 0 serves the store at MASTER_ADDR:MASTER_PORT (spmd/rank/master_store.py), as
            # torchrun's agent does: every rank's init_process_group() connects to it.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }


def elastic_layout(ranks, hosts) -> dict[int, RankEnv]:
    """``{proc-mesh rank: RankEnv}`` for ``ranks`` (in mesh order, so a slice's first rank
    is RANK 0) whose hosts are ``hosts`` (one name per rank; all equal on one machine).
    Local ranks count within each host, in mesh order::

        >>> lay = elastic_layout([0, 1, 2, 3], ["a", "a", "b", "b"])
        >>> (lay[3].rank, lay[3].local_rank, lay[3].local_world_size, lay[3].group_rank)
        (3, 1, 2, 1)
    """
    ranks, hosts = list(ranks), list(hosts)
    if len(ranks) != len(hosts):
        raise ValueError(f"{counted(len(ranks), 'rank')} but {counted(len(hosts), 'host name')}")
    order: dict[str, int] = {}
    for h in hosts:
        order.setdefault(h, len(order))
    per_host = {h: hosts.count(h) for h in order}
    seen: dict[str, int] = {}
    out = {}
    for i, (r, h) in enumerate(zip(ranks, hosts, strict=True)):
        local = seen.get(h, 0)
        seen[h] = local + 1
        out[r] = RankEnv(i, len(ranks), local, per_host[h], order[h], len(order))
    return out


def layout_from_point(coords, sizes) -> RankEnv:
    """Monarch's rule, for an ``SPMDActor`` spawned without a layout: the last dim is the
    ranks of one host (``{"hosts": 2, "gpus": 4}``: LOCAL_WORLD_SIZE 4)."""
    sizes = list(sizes) or [1]
    coords = list(coords) or [0]
    rank = 0
    for c, s in zip(coords, sizes, strict=True):
        rank = rank * s + c
    world = math.prod(sizes)
    local_world = sizes[-1]
    return RankEnv(rank, world, coords[-1], local_world, rank // local_world, world // local_world)
