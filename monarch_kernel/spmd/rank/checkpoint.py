"""``PeerCheckpoint``: the model's and optimizer's state kept in this rank's memory after
every step, so that a rank that replaces a dead one pulls it from a survivor through
``RDMABuffer`` instead of from a file.

Runs on ranks, in the user's training loop.  Two snapshots are kept (the last step and the
one before), so survivors that got one step further than others can step back to a step
every rank can reach.  Only replicated state (DDP's) can be pulled this way: a sharded
tensor's other copy died with its rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

ALIGN = 64  # bytes: every tensor starts aligned, so a typed view of the flat buffer is legal


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor of a state dict lies in a snapshot's flat buffer."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple


class _Snapshot:
    def __init__(self, name: str):
        self.name = name  # the RDMABuffer's name, for messages
        self.step = -1
        self.skeleton: Any = None  # the state dicts, each tensor replaced by a _Tensor
        self.flat: Any = None  # a uint8 torch tensor holding every tensor's bytes
        self.buffer: Any = None  # the RDMABuffer over flat, registered when first asked for

    def handle(self):
        if self.buffer is None:
            from ...data.buffer import RDMABuffer

            self.buffer = RDMABuffer(self.flat, name=self.name)
        return self.buffer

    def resize(self, nbytes: int) -> None:
        import torch

        if self.flat is None or self.flat.numel() != nbytes:
            self.drop()
            self.flat = torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def drop(self) -> None:
        if self.buffer is not None:
            self.buffer.drop()
            self.buffer = None


class PeerCheckpoint:
    """An in-memory checkpoint shared with peers, for training that survives a rank's death::

        ckpt = PeerCheckpoint.get("ddp")     # survivors find theirs; a new rank an empty one
        start = ckpt.restore(model, opt)     # after the group is (re)built: the step to go on from
        ddp = DistributedDataParallel(model)
        for step in range(start, steps):
            ...
            ckpt.save(step + 1, model, opt)  # the state after step + 1 completed steps

    ``save`` copies the state dicts of ``model``, ``opt`` (anything with ``state_dict`` and
    ``load_state_dict``) into memory registered for ``RDMABuffer``.  ``restore`` is a
    collective over the default process group: the ranks agree on the latest step they all
    can reach, ranks holding it load their own copy, and fresh ranks read it from a survivor
    (ranks spread over the holders) rank to rank; it returns that step (0 with no state anywhere).
    """

    _instances: dict[str, PeerCheckpoint] = {}
    _instances_lock = threading.Lock()

    def __init__(self, name: str = "default"):
        self.name = name
        self._snaps = [_Snapshot(f"peer-checkpoint-{name}"), _Snapshot(f"peer-checkpoint-{name}")]
        self._latest = -1  # index of the newest snapshot, -1 before the first save
        self.restored_from: int | None = None  # the global rank the last restore read from (None: itself)

    @classmethod
    def get(cls, name: str = "default") -> PeerCheckpoint:
        """This process's checkpoint called ``name``, made on first use."""
        with cls._instances_lock:
            ckpt = cls._instances.get(name)
            if ckpt is None:
                ckpt = cls._instances[name] = cls(name)
            return ckpt

    @property
    def step(self) -> int | None:
        """The newest saved step here, or None."""
        return self._snaps[self._latest].step if self._latest >= 0 else None

    def steps(self) -> list[int]:
        """The steps held here, newest first."""
        if self._latest < 0:
            return []
        return [s.step for s in (self._snaps[self._latest], self._snaps[1 - self._latest]) if s.step >= 0]

    # ------------------------------------------------------------ saving

    def save(self, step: int, *stateful) -> None:
        """Keep the state of ``stateful`` after ``step`` completed steps (the older of the two
        snapshots is overwritten)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"save(step, ...) takes the number of completed steps, a non-negative int; got {step!r}")
        if not stateful:
            raise TypeError("save(step, model, optimizer, ...): give the objects whose state_dict() to keep")
        import torch

        tensors: list = []
        skeleton = [_strip(obj.state_dict(), tensors, torch) for obj in stateful]
        total = 0
        places = []
        for t in tensors:
            total = -(-total // ALIGN) * ALIGN
            nbytes = t.numel() * t.element_size()
            places.append(_Tensor(total, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            total += nbytes
        slot = 1 - self._latest if self._latest >= 0 else 0
        snap = self._snaps[slot]
        snap.resize(total)
        for t, p in zip(tensors, places, strict=True):
            if p.nbytes:
                snap.flat[p.offset:p.offset + p.nbytes].copy_(t.detach().reshape(-1).contiguous().view(torch.uint8))
        snap.skeleton = _fill(skeleton, iter(places))
        snap.step = step
        self._latest = slot

    # ------------------------------------------------------------ restoring

    def restore(self, *stateful, group=None, timeout: float = 120.0) -> int:
        """Load the latest step every rank can reach into ``stateful`` (same order as in
        ``save``) and return it; a collective: every rank of the group calls it."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self._load_own(self.step, stateful) if self._latest >= 0 else 0
        me = dist.get_rank(group)
        offers = {s.step: (s.skeleton, s.handle()) for s in self._snaps if s.step >= 0}
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, {"rank": me, "offers": offers}, group=group)
        holders = [g for g in gathered if g["offers"]]
        if not holders:
            dist.barrier(group=group)
            return 0
        target = min(max(g["offers"]) for g in holders)
        lacking = [g["rank"] for g in holders if target not in g["offers"]]
        if lacking:
            raise RuntimeError(f"no step every rank can reach: ranks {lacking} hold none of step {target} "
                               f"(steps held: {[sorted(g['offers']) for g in gathered]})")
        if target in offers:
            self.restored_from = None
            got = self._load_own(target, stateful)
        else:
            fresh = [g["rank"] for g in gathered if not g["offers"]]
            donor = holders[fresh.index(me) % len(holders)]
            got = self._pull(target, donor, stateful, timeout)
        dist.barrier(group=group)  # donors keep their buffers until every reader is done
        return got

    def _load_own(self, step, stateful) -> int:
        for i, snap in enumerate(self._snaps):
            if snap.step == step:
                _load(snap.skeleton, snap.flat, stateful)
                if snap.step < max(s.step for s in self._snaps):
                    self._snaps[1 - i].step = -1  # a step the others never reached: forget it
                self._latest = i
                return step
        raise KeyError(step)

    def _pull(self, step: int, donor: dict, stateful, timeout: float) -> int:
        import torch

        skeleton, buffer = donor["offers"][step]
        dst = torch.empty(max(buffer.size, 1), dtype=torch.uint8)
        buffer.read_into(dst, timeout=timeout).get(timeout=timeout)
        _load(skeleton, dst, stateful)
        snap = self._snaps[0]
        snap.drop()
        snap.flat, snap.skeleton, snap.step = dst, skeleton, step
        self._snaps[1].step = -1
        self._latest = 0
        self.restored_from = donor["rank"]
        return step

    def __repr__(self) -> str:
        return f"PeerCheckpoint<{self.name!r} steps {self.steps()}>"


def _strip(obj, tensors: list, torch):
    """The state dict with each tensor replaced by its index in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise TypeError(f"PeerCheckpoint keeps plain tensors only, not {type(obj).__name__} (a sharded "
                            "tensor's other parts died with their rank: save replicated (DDP) state)")
        tensors.append(obj.detach().cpu() if obj.device.type != "cpu" else obj.detach())
        return _Index(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors, torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors, torch) for v in obj)
    return obj


@dataclass(frozen=True)
class _Index:
    i: int


def _fill(obj, places):
    if isinstance(obj, _Index):
        return next(places)
    if isinstance(obj, dict):
        return {k: _fill(v, places) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, places) for v in obj)
    return obj


def _load(skeleton, flat, stateful) -> None:
    import torch

    if len(skeleton) != len(stateful):
        raise TypeError(f"restore got {len(stateful)} objects but {len(skeleton)} were saved; pass the same ones, "
                        "in the same order, as to save()")
    for obj, sd in zip(stateful, skeleton, strict=True):
        obj.load_state_dict(_tensors(sd, flat, torch))


def _tensors(obj, flat, torch):
    if isinstance(obj, _Tensor):
        dtype = getattr(torch, obj.dtype)
        if not obj.nbytes:
            return torch.empty(obj.shape, dtype=dtype)
        return flat[obj.offset:obj.offset + obj.nbytes].view(dtype).view(obj.shape).clone()
    if isinstance(obj, dict):
        return {k: _tensors(v, flat, torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v, flat, torch) for v in obj)
    return obj
