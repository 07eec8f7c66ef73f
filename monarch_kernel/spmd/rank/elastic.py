"""The ranks' half of ``elastic_run``: the loop a training function writes
(``elastic_steps``), which restores from peers' memory on entry, keeps each completed step
there, and leaves at a step boundary every rank agrees on when the controller resizes the
job; and the two actors the controller drives it through.

Runs on ranks.  torch is imported only when a loop runs; state never goes to a file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from ...actor.actor import Actor
from ...actor.endpoint import endpoint
from ...runtime import config
from ..layout import RankEnv
from . import group, master_store
from .actor import ElasticEnvActor
from .checkpoint import PeerCheckpoint

SETUP_TIMEOUT_S = config.seconds("spmd_setup_timeout")
CONNECT_S = config.seconds("elastic_store_connect")  # a store closed meanwhile is retried that long

_resize = threading.Event()  # the controller asked this rank to leave its loop at the next step boundary
# The failures of attempts cut short by a peer's death, kept with their frames: freeing them
# would free that attempt's DDP, whose reducer holds the aborted gloo group, whose destructor
# joins gloo's threads, one of which may wait forever on the dead peer.  A model and an
# optimizer per death, for the life of the process.
_cut_short: list[BaseException] = []
_made = {"generation": -1}  # the generation of the group last made here (ElasticRank.run checks it)


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
    group's abort when a peer dies, and the resize request.

    Each membership is a *generation* (numbered by the controller).  The group is made on a
    thread of its own (``make_group``, then ``group_made``), so that an abort reaches this
    actor while torch's rendezvous waits for a member that died; an abort or a resize meant
    for an older generation than the one this rank was placed in is ignored (a late one
    must not break the group made after it)."""

    def __init__(self):
        super().__init__({})
        self.place_env: RankEnv | None = None
        self.generation = -1  # the membership this rank was last placed in
        self.maker: _GroupMaker | None = None
        self.lock = threading.Lock()

    def _env(self) -> RankEnv:
        if self.place_env is None:
            raise RuntimeError("elastic_run has not placed this rank yet")
        return self.place_env

    @endpoint
    def ready(self) -> int:
        """This process's pid, once torch.distributed is imported: a rank that joins pays
        for the import before the others stop for it."""
        import torch.distributed  # noqa: F401

        return os.getpid()

    @endpoint
    def place(self, env: RankEnv, generation: int = 0) -> None:
        """This rank's place in the group of ``generation``; an older group still being made
        here is abandoned first (its store closed, so its rendezvous fails at once)."""
        with self.lock:
            self.generation = generation
            old = self.maker
        if old is not None:
            old.abandon()
        self.place_env = env
        _resize.clear()

    @endpoint
    def make_group(self, backend: str, timeout_s: float, generation: int, rendezvous_s: float | None = None) -> None:
        """Start making the group of ``generation`` (``group_made`` says when it is up): its
        rendezvous given ``rendezvous_s`` (default ``timeout_s``), its collectives ``timeout_s``."""
        with self.lock:
            if generation != self.generation:
                raise RuntimeError(f"asked to make the group of generation {generation}, but this rank was "
                                   f"placed in generation {self.generation}")
            old, maker = self.maker, _GroupMaker(self._env(), backend, timeout_s, generation,
                                                 timeout_s if rendezvous_s is None else rendezvous_s)
            self.maker = maker
        if old is not None:
            old.abandon()
        maker.start()

    @endpoint
    def group_made(self, generation: int, wait_s: float) -> str | None:
        """The group's backend once the group of ``generation`` is up here, None while it is
        being made (after waiting up to ``wait_s``); raises what making it raised."""
        maker = self.maker
        if maker is None or maker.generation != generation:
            raise RuntimeError(f"this rank is not making the group of generation {generation}")
        return maker.result(wait_s)

    @endpoint
    def abort(self, reason: str = "", generation: int | None = None) -> bool:
        """Abort this rank's group (of ``generation`` or older; any, when None), and a
        rendezvous for it in progress, so what waits on it fails now."""
        with self.lock:
            if generation is not None and generation < self.generation:
                return False  # a later group is being made or up here: that death is not its
            maker = self.maker
        if maker is not None and (generation is None or maker.generation <= generation):
            maker.abort()
        return group.abort_group(reason)

    @endpoint
    def resize(self, generation: int | None = None) -> None:
        """Leave the loop at the next step boundary (every rank agrees on which)."""
        if generation is None or generation == self.generation:
            _resize.set()


class _GroupMaker:
    """One generation's ``init_process_group`` on a thread of its own.

    The group is made with ``rendezvous_s`` as torch's timeout, then given ``timeout_s`` for
    its collectives: a member that dies after publishing its address leaves the others'
    gloo retrying a connection to it, which closing the store does not stop; it gives up
    within ``rendezvous_s``, not the group's timeout."""

    def __init__(self, env: RankEnv, backend: str, timeout_s: float, generation: int, rendezvous_s: float):
        self.generation = generation
        self.aborted = False
        self.done = threading.Event()
        self.backend: str | None = None
        self.error: BaseException | None = None
        self.rendezvous_s = rendezvous_s
        self.thread = threading.Thread(target=self._make, args=(env, backend, timeout_s), daemon=True,
                                       name=f"elastic-group-{generation}")

    def start(self) -> None:
        self.thread.start()

    def _make(self, env: RankEnv, backend: str, timeout_s: float) -> None:
        try:
            self._check()
            store = _store_client(timeout_s)
            self._check()  # aborted while it connected: the store may be closed already
            got = group.init_group(backend, env, self.rendezvous_s, store=store)
            group.set_timeout(timeout_s)
            if self.aborted:  # it came up after its abort: the others may be gone from it already
                group.abort_group(f"the group of generation {self.generation} was aborted while it was made")
                raise RuntimeError(f"the group of generation {self.generation} was aborted while it was made")
            _made["generation"] = self.generation
            self.backend = got
        except BaseException as e:  # the controller hears it from group_made
            self.error = e
        finally:
            self.done.set()

    def _check(self) -> None:
        if self.aborted:
            raise RuntimeError(f"the group of generation {self.generation} was aborted (a member died)")

    def result(self, wait_s: float) -> str | None:
        if not self.done.wait(wait_s):
            return None
        if self.error is not None:
            raise self.error
        return self.backend

    def abort(self) -> None:
        """A member died: the rendezvous in progress fails now on every rank (the store it
        meets at, if served here, is closed), and the group, if it comes up, is aborted."""
        self.aborted = True
        if not self.done.is_set():
            master_store.close_unused()

    def abandon(self) -> None:
        """A later generation replaces this one: end it, waiting for its thread."""
        if self.done.is_set():
            return
        self.abort()
        wait_s = self.rendezvous_s + SETUP_TIMEOUT_S
        if not self.done.wait(wait_s):
            raise RuntimeError(f"the group of generation {self.generation} is still being made after "
                               f"{wait_s:g} s (stuck in torch's rendezvous); see procs.stacks()")


def _store_client(timeout_s: float):
    """A client of this generation's store (``MASTER_ADDR:MASTER_PORT``, served by the first
    member before any member is asked to make the group, so it connects at once); its
    requests then wait up to ``timeout_s``.  Closing the store fails them at once."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=CONNECT_S))
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


class ElasticRank(Actor):
    """Runs the user's training function; on the rank's main thread when it is free, so the
    stop button interrupts it."""

    runs_on_main_thread = True

    @endpoint
    def run(self, fn, args: tuple, kwargs: dict, generation: int | None = None) -> tuple[str, Any]:
        """``("done", fn(*args, **kwargs))``, or ``("resize", step)`` when it left at a step
        boundary for a resize.  ``generation``: the group the controller made for this call;
        a rank whose group is another says so rather than wait in a collective nobody joins."""
        if generation is not None and _made["generation"] != generation:
            raise RuntimeError(f"this rank's process group is of generation {_made['generation']}, "
                               f"not {generation} as the controller made it")
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
