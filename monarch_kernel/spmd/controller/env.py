"""The controller's half of torchrun's environment on a mesh: one ``ElasticEnvActor`` per
mesh (respawned when a rank was replaced), rank 0's rendezvous address, and a watcher that
aborts the survivors' process group the moment a rank dies.

Runs in the controller (the kernel or a script).  It never imports torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ...runtime import Runtime, config
from ..layout import RankEnv, elastic_layout
from ..rank.actor import ElasticEnvActor

SETUP_TIMEOUT_S = config.seconds("spmd_setup_timeout")


@dataclass
class MeshRecord:
    """What the controller knows of one mesh's distributed set-up."""

    ranks: tuple  # proc-mesh ranks, in mesh order
    layout: dict[int, RankEnv]
    env: Any = None  # the ElasticEnvActor mesh
    pids: tuple = ()  # the ranks' pids when env was spawned: a replaced rank has another
    master: tuple = ()  # (addr, port) of the last rendezvous
    backend: str | None = None  # set once setup_torch_distributed made a group
    stale: bool = False  # a rank died since the group was made
    device_mesh: Any = None  # the last DeviceMeshHandle built over the group
    hook: Any = None  # the runtime death hook's handle
    lock: threading.Lock = field(default_factory=threading.Lock)


_records: dict[tuple, MeshRecord] = {}
_records_lock = threading.Lock()


def has_record(procs) -> bool:
    """Whether torchrun's variables were set up on ``procs`` (so its ranks may be in collectives)."""
    with _records_lock:
        return (procs.ref.id, tuple(procs.shape.ranks)) in _records


def existing_env(procs) -> tuple[tuple, object] | None:
    """``(proc-mesh ranks, ElasticEnvActor mesh)`` if one was spawned on ``procs``, else None;
    it spawns nothing (the hang watchdog asks from its own thread, while calls are pending)."""
    with _records_lock:
        rec = _records.get((procs.ref.id, tuple(procs.shape.ranks)))
    return (rec.ranks, rec.env) if rec is not None and rec.env is not None else None


def record(procs) -> MeshRecord:
    """The mesh's record, its ``ElasticEnvActor`` spawned (again, if a rank was replaced, or
    moved to another host: its ``LOCAL_RANK`` and the hosts' counts are then another's)."""
    ref = procs.ref
    ranks = tuple(procs.shape.ranks)
    key = (ref.id, ranks)
    layout = elastic_layout(ranks, [ref.hosts[r] if ref.hosts else "" for r in ranks])
    with _records_lock:
        rec = _records.get(key)
        if rec is None:
            rec = _records[key] = MeshRecord(ranks, layout)
    pids = _pids(procs)
    if rec.env is None or not pids or pids != rec.pids or layout != rec.layout:
        rec.layout = layout
        rec.env = procs.spawn("spmd_env", ElasticEnvActor, rec.layout)
        rec.env.initialized().get(timeout=SETUP_TIMEOUT_S)
        rec.pids = pids
    if rec.hook is None and procs.owned:
        rec.hook = Runtime.current().hooks.death.install(_watcher(ref.id, rec))
    return rec


def setup_torch_elastic_env(procs, master_addr: str | None = None, master_port: int | None = None) -> tuple[str, int]:
    """Give every rank of ``procs`` torchrun's variables (Monarch's name), so
    ``torch.distributed.init_process_group()`` and torchrun scripts work unchanged::

        procs = this_host().spawn_procs(per_host={"gpus": 4})
        setup_torch_elastic_env(procs)

    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` count the ranks of each host; ``MASTER_ADDR`` is
    rank 0's address the others can reach (127.0.0.1 on one host; its host's address when
    the ranks span hosts) and ``MASTER_PORT`` a free port there, unless given.  Returns
    ``(master_addr, master_port)``.  Call it again after ``%mesh restart``."""
    check_alive(procs)
    rec = record(procs)
    return _rendezvous(procs, rec, master_addr, master_port)


async def setup_torch_elastic_env_async(procs, master_addr: str | None = None,
                                        master_port: int | None = None) -> tuple[str, int]:
    """``setup_torch_elastic_env`` for async code (Monarch's name): it runs on a thread, so
    the event loop keeps going.

    Example::

        addr, port = await setup_torch_elastic_env_async(procs)
    """
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(
        None, setup_torch_elastic_env, procs, master_addr, master_port)


def check_alive(procs) -> None:
    """A mesh with dead ranks cannot make a group: say how to replace them."""
    if procs.stopped:
        raise RuntimeError(f"mesh '{procs.name}' is stopped; spawn a new one")
    dead = procs.dead_ranks()
    if dead:
        raise RuntimeError(f"ranks {dead} of mesh '{procs.name}' are dead: replace them first "
                           f"(%mesh restart, or procs.restart({dead}, ...)), then set the group up again")


def _rendezvous(procs, rec: MeshRecord, master_addr, master_port) -> tuple[str, int]:
    flat = rec.env.flatten("rank")
    if master_addr is None or master_port is None:
        spans = len({procs.ref.hosts[r] for r in rec.ranks}) > 1 if procs.ref.hosts else False
        peer = peer_ip(procs, rec.ranks)
        addr, port = flat.slice(rank=0).rendezvous.call_one(spans, peer).get(timeout=SETUP_TIMEOUT_S)
        master_addr = addr if master_addr is None else master_addr
        master_port = port if master_port is None else master_port
    flat.setup_env.call(master_addr, int(master_port)).get(timeout=SETUP_TIMEOUT_S)
    rec.master = (master_addr, int(master_port))
    return master_addr, int(master_port)


def peer_ip(procs, ranks) -> str | None:
    """The IP of one of ``ranks`` on another host than the first (from its tcp:// inbox), if any."""
    ref = procs.ref
    if not ref.hosts:
        return None
    first = ref.hosts[ranks[0]]
    for r in ranks:
        address = ref.addresses[r]
        if ref.hosts[r] != first and address.startswith("tcp://"):
            return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return None


def _pids(procs) -> tuple:
    if not procs.owned:
        return ()
    rows = procs.rank_states()
    return tuple(row["pid"] for row in rows)


def _watcher(mesh_id: str, rec: MeshRecord):
    """The death hook: a rank of the mesh died (not stopped), so its peers' collectives can
    never finish; abort their group now instead of at the group's timeout."""

    def on_death(dead_mesh: str, rank: int, info) -> None:  # on the IO thread: must not block
        if dead_mesh != mesh_id or rank not in rec.ranks:
            return
        if info.stopped:
            if rec.hook is not None:
                rec.hook.remove()
                rec.hook = None
            return
        rec.stale = True
        env = rec.env
        if env is None:
            return
        reason = f"rank {rank} ({info.how()})"
        threading.Thread(target=_abort_peers, args=(env, rec, rank, reason), name="spmd-abort",
                         daemon=True).start()

    return on_death


def _abort_peers(env, rec: MeshRecord, dead: int, reason: str) -> None:
    from ...actor.errors import ActorError, MeshStopped

    flat = env.flatten("rank")
    futures = [flat.slice(rank=i).abort.call_one(f"{reason} died")
               for i, r in enumerate(rec.ranks) if r != dead]
    for f in futures:
        try:
            f.get(timeout=10)
        except (ActorError, MeshStopped, ConnectionError, TimeoutError):
            pass  # that rank is gone too, or busy: its own death or timeout reports it
