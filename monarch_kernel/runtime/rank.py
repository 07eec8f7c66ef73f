"""The rank process: a runtime built from its launch config, serving until told to stop.

Entered in a child forked by the template.  It never imports the user's ``__main__`` or
torch; what a call needs arrives pickled.  It exits when its template (and so its
controller) is gone: the parent-death signal, checked again by a one-second watchdog.
The IO loop runs on a thread; the main thread is lent to one actor (the notebook console)
so that interrupts are real signals.  A spawner's bootstrap function runs before the rank
says hello, so nothing the user spawns there runs before it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys

from . import config, finalize, rank_logging
from .context import process_mesh
from .envelope import Header, Kind, Part, Status, join_parts
from .failure import RemoteFailure
from .hosts import enter_netns
from .io_thread import IOThread
from .launch import LaunchConfig
from .main_thread import MainThread
from .process import Runtime
from .serialize import dumps

WATCHDOG_S = 1.0


def run_rank(cfg: LaunchConfig, template_pid: int) -> None:
    sys.path[:] = cfg.sys_path
    finalize.snapshot_modules()
    rank = cfg.rank
    ref = cfg.mesh
    try:
        os.chdir(cfg.cwd)
    except OSError:
        pass
    os.environ.update(cfg.env)
    if netns := config.netns():
        enter_netns(netns)  # before any thread or socket exists
    # torchrun's variables, so torch.distributed.init_process_group() works unchanged.
    size = ref.size
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", size), ("LOCAL_WORLD_SIZE", size)):
        os.environ.setdefault(name, str(value))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if cfg.master_port:
        os.environ.setdefault("MASTER_PORT", str(cfg.master_port))
    main = MainThread()
    main.install()
    io = IOThread(name="monarch-io")
    rt = Runtime(cfg.key, cfg.rundir, f"{ref.id}.{rank}", io, owner=cfg.owner, address=cfg.address,
                 curve=cfg.curve)
    rt.main_thread = main
    rt.fanout = cfg.fanout
    Runtime._current = rt
    rt.memberships[ref.id] = (ref, rank)
    rt.job_ports.update(cfg.job_ports)
    process_mesh[0], process_mesh[1] = ref, rank
    rank_logging.install()
    hello = Header(Kind.HELLO, mesh=ref.id, ranks=[rank], extra=os.getpid())
    failed = run_bootstrap(cfg.bootstrap, rank)
    rt.transport.send(cfg.owner, hello, join_parts(hello, [failed]) if failed is not None else [])

    beat = Header(Kind.HEARTBEAT, mesh=ref.id, ranks=[rank])

    def watchdog():
        if os.getppid() != template_pid:
            os._exit(1)
        # The owner shows a rank whose beats stop (SIGSTOP, a stuck process) as not responding.
        rt.send_or_report(cfg.owner, beat, [], "a heartbeat")
        io.loop.call_later(WATCHDOG_S, watchdog)

    io.call_soon(io.loop.call_later, WATCHDOG_S, watchdog)
    main.serve_forever()


def run_bootstrap(pickled: bytes | None, rank: int) -> Part | None:
    """Run the spawner's bootstrap function (sync, or a coroutine function run to its end);
    what it raised, as a RAISED part for the hello, or None."""
    if pickled is None:
        return None
    name = "bootstrap"
    try:
        fn = pickle.loads(pickled)
        name = getattr(fn, "__qualname__", name)
        result = fn()
        if inspect.isawaitable(result):
            async def finish():
                await result

            asyncio.run(finish())
    except BaseException as e:  # noqa: BLE001  (it fails the spawn, with its traceback, instead)
        return Part(rank, Status.RAISED, dumps(RemoteFailure.capture(rank, "bootstrap", name, e)))
    return None
