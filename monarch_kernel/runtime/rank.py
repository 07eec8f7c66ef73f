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
import sys

from . import config, diagnostics, rank_logging
from .calls import finalize
from .calls.main_thread import MainThread
from .failure import RemoteFailure
from .limits import raise_nofile_limit
from .net.hosts import enter_netns
from .process import Runtime
from .spawn.host_messages import RankHello
from .spawn.launch_config import LaunchConfig
from .spawn.template_channel import MAX_CONTROL
from .wire.envelope import Part, Status
from .wire.serialize import dumps
from .wire.unpickling import loads

WATCHDOG_S = config.seconds("rank_beat")


def tell_template(control: int, frame: bytes) -> None:
    """One frame on the control pipe to the template (which forwards it to the owner): a
    hello, or an empty frame, a heartbeat.  The template gone: so is this rank."""
    try:
        os.write(control, len(frame).to_bytes(4, "big") + frame)
    except OSError:
        os._exit(1)


def run_rank(cfg: LaunchConfig, template_pid: int, control: int) -> None:
    sys.path[:] = cfg.sys_path
    finalize.snapshot_modules()
    raise_nofile_limit()
    rank = cfg.rank
    ref = cfg.mesh
    try:
        os.chdir(cfg.cwd)
    except OSError:
        pass
    os.environ.update(cfg.env)
    if netns := config.netns():
        enter_netns(netns)  # before any thread or socket exists
    main = MainThread()
    main.install()
    # procs this rank spawns start through the same interpreter (cfg.python)
    io = Runtime.for_rank(cfg, main).io
    rank_logging.install()
    diagnostics.install()
    failed = run_bootstrap(cfg.bootstrap, rank)
    # Through the template, which forwards its ranks' hellos and beats together: a rank never
    # needs a connection of its own to its owner to come up or stay known as alive.
    tell_template(control, RankHello(ref.id, rank, os.getpid(), None if failed is None else int(failed.status),
                                     [] if failed is None else [bytes(f) for f in failed.frames]).encode())

    def watchdog():
        if os.getppid() != template_pid:
            os._exit(1)
        # The owner shows a rank whose beats stop (SIGSTOP, a stuck process) as not responding.
        tell_template(control, b"")
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
        fn = loads(pickled)
        name = getattr(fn, "__qualname__", name)
        result = fn()
        if inspect.isawaitable(result):
            async def finish():
                await result

            asyncio.run(finish())
    except BaseException as e:  # noqa: BLE001  (it fails the spawn, with its traceback, instead)
        frames = dumps(RemoteFailure.capture(rank, "bootstrap", name, e))
        n = sum(memoryview(f).nbytes for f in frames)
        if n > MAX_CONTROL - 4096:  # the hello must fit the template's pipe frame: say less
            short = RuntimeError(f"{type(e).__name__}: {str(e)[:2000]} (the whole error, {n} bytes pickled, "
                                 "is too large to report from a rank's bootstrap)")
            frames = dumps(RemoteFailure.capture(rank, "bootstrap", name, short))
        return Part(rank, Status.RAISED, frames)
    return None
