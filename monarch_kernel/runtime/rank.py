"""The rank process: a runtime built from its launch config, serving until told to stop.

Entered in a child forked by the template.  It never imports the user's ``__main__`` or
torch; what a call needs arrives pickled.  It exits when its template (and so its
controller) is gone: the parent-death signal, checked again by a one-second watchdog.
The IO loop runs on a thread; the main thread is lent to one actor (the notebook console)
so that interrupts are real signals.
"""

from __future__ import annotations

import os
import sys

from . import config
from .context import process_mesh
from .envelope import Header, Kind
from .hosts import enter_netns
from .io_thread import IOThread
from .launch import LaunchConfig
from .main_thread import MainThread
from .process import Runtime

WATCHDOG_S = 1.0


def run_rank(cfg: LaunchConfig, template_pid: int) -> None:
    sys.path[:] = cfg.sys_path
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
    rt = Runtime(cfg.key, cfg.rundir, f"{ref.id}.{rank}", io, owner=cfg.owner)
    rt.main_thread = main
    rt.fanout = cfg.fanout
    Runtime._current = rt
    rt.memberships[ref.id] = (ref, rank)
    process_mesh[0], process_mesh[1] = ref, rank
    rt.transport.send(cfg.owner, Header(Kind.HELLO, mesh=ref.id, ranks=[rank], extra=os.getpid()), [])

    beat = Header(Kind.HEARTBEAT, mesh=ref.id, ranks=[rank])

    def watchdog():
        if os.getppid() != template_pid:
            os._exit(1)
        # The owner shows a rank whose beats stop (SIGSTOP, a stuck process) as not responding.
        rt.send_or_report(cfg.owner, beat, [], "a heartbeat")
        io.loop.call_later(WATCHDOG_S, watchdog)

    io.call_soon(io.loop.call_later, WATCHDOG_S, watchdog)
    main.serve_forever()
