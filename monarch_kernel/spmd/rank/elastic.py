"""The ranks' half of ``elastic_run``: the loop a training function writes
(``elastic_steps``), which restores from peers' memory on entry, keeps each completed step
there, and leaves at a step boundary every rank agrees on when the controller resizes the
job; and the two actors the controller drives it through.

Runs on ranks.  torch is imported only when a loop runs; state never goes to a file.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ...actor.actor import Actor
from ...actor.endpoint import endpoint
from ..layout import RankEnv
from .actor import ElasticEnvActor
from .checkpoint import PeerCheckpoint

_resize = threading.Event()  # the controller asked this rank to leave its loop at the next step boundary
# The failures of attempts cut short by a peer's death, kept with their frames: freeing them
# would free that attempt's DDP, whose reducer holds the aborted gloo group, whose destructor
# joins gloo's threads, one of which may wait forever on the dead peer.  A model and an
# optimizer per death, for the life of the process.
_cut_short: list[BaseException] = []


class Resize(Exception):  # noqa: N818  (a signal to the worker, not an error)
    """Raised out of ``elastic_steps`` at a step boundary when the controller resizes the
    job (a rank came back): ``elastic_run`` rebuilds the group and calls the function again.
    Let it through: a training function that catches it would not be resized.

    Example::

        def train(steps):
            for step in elastic_steps(steps, model, opt):   # may raise Resize: let it go
                ...
    """

    def __init__(self, step: int):
        super().__init__(f"resized at step {step}")
        self.step = step


def elastic_steps(total: int, *stateful, name: str = "elastic") -> Iterator[int]:
    """The steps of an elastic training loop, inside a function run by ``elastic_run``::

        def train(steps):
            model, opt = make_model(), make_optimizer()
            ddp = DistributedDataParallel(model)
            for step in elastic_steps(steps, model, opt):   # restores, then yields 0.. or where it left off
                ...                                          # one step, over dist.get_world_size() ranks
            return loss.item()

    On entry it restores ``stateful`` (same order every time) from the peers' memory
    (``PeerCheckpoint(name).restore``: a replaced or added rank reads it from a survivor);
    after each step it keeps the state there; before each step the ranks agree (one small
    all-reduce) whether the controller asked them to resize, and if so leave together by
    raising ``Resize``."""
    if not stateful:
        raise TypeError("elastic_steps(total, model, optimizer, ...): give the objects whose state_dict() "
                        "to keep in peers' memory")
    import torch
    import torch.distributed as dist

    ckpt = PeerCheckpoint.get(name)
    start = ckpt.restore(*stateful)
    if start:
        src = "this rank's memory" if ckpt.restored_from is None else f"rank {ckpt.restored_from}'s memory"
        print(f"resumed after step {start} from {src} ({dist.get_world_size()} ranks)", flush=True)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(start, total):
        flag.fill_(1 if _resize.is_set() else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise Resize(step)
        yield step
        ckpt.save(step + 1, *stateful)


class ElasticControl(ElasticEnvActor):
    """On its own thread: torchrun's variables and the process group for this rank's place
    in the current membership (given by the controller, which changes it on a resize), the
    group's abort when a peer dies, and the resize request."""

    def __init__(self):
        super().__init__({})
        self.place_env: RankEnv | None = None

    def _env(self) -> RankEnv:
        if self.place_env is None:
            raise RuntimeError("elastic_run has not placed this rank yet")
        return self.place_env

    @endpoint
    def place(self, env: RankEnv) -> None:
        """This rank's place in the next group."""
        self.place_env = env
        _resize.clear()

    @endpoint
    def resize(self) -> None:
        """Leave the loop at the next step boundary (every rank agrees on which)."""
        _resize.set()


class ElasticRank(Actor):
    """Runs the user's training function; on the rank's main thread when it is free, so the
    stop button interrupts it."""

    runs_on_main_thread = True

    @endpoint
    def run(self, fn, args: tuple, kwargs: dict) -> tuple[str, Any]:
        """``("done", fn(*args, **kwargs))``, or ``("resize", step)`` when it left at a step
        boundary for a resize."""
        _same_threads()
        try:
            return "done", fn(*args, **kwargs)
        except Resize as r:
            return "resize", r.step
        except BaseException as e:
            _cut_short.append(e)
            raise


def _same_threads() -> None:
    """OpenMP's thread count is per thread: this worker's may not be the one torch was set
    to (a rank's first actor had the main thread).  Make it so, for sums split the same way
    on every attempt, hence the same losses as an uninterrupted run."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())
