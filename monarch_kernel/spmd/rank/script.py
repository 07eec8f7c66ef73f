"""Running an unmodified torchrun script on a warm rank: ``sys.argv`` as torchrun sets it,
the script run as ``__main__`` (a path, or ``-m module``), and ``init_process_group`` /
``destroy_process_group`` made to fit a group the rank may already have.

Runs on ranks, inside an endpoint (``SPMDActor.main``, or the notebook console for
``%mesh run``).  It never imports torch itself; a script that fails or is interrupted
aborts its group, so peers waiting for it in a collective fail at once too.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from collections.abc import Callable

from . import group


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status.

    Example::

        %mesh run train.py --epochs 0      # sys.exit(2) in train.py: ScriptExit on each rank
    """


_run_lock = threading.Lock()


def run_script(script_args) -> bool:
    """Run ``script_args`` (``["train.py", "--lr", "0.1"]`` or ``["-m", "pkg.train", ...]``)
    as torchrun would run it on this rank; True once it returns (or exits with status 0).

    Example::

        %%mesh
        from monarch_kernel.spmd import run_script
        run_script(["train.py", "--lr", "0.1"])
    """
    argv = [str(a) for a in script_args]
    if not argv or argv == ["-m"]:
        raise ValueError("no script to run: give a path (train.py --lr 0.1) or a module (-m pkg.train --lr 0.1)")
    if not _run_lock.acquire(blocking=False):
        raise RuntimeError("a script is already running on this rank; wait for it, or interrupt it, first")
    old_argv, old_path = sys.argv, list(sys.path)
    guard = _GroupGuard()
    try:
        guard.install()
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(os.path.expanduser(argv[0]))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{argv[0]}: no such file on this rank (cwd {os.getcwd()}); "
                                        "%mesh sync its folder, or run it as -m MODULE")
            sys.argv = [path, *argv[1:]]
            sys.path.insert(0, os.path.dirname(path))  # as `python train.py` does
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _to_the_end(group.abort_group)
            raise ScriptExit(f"{argv[0]} exited with status {e.code!r}") from None
    except BaseException as e:
        _to_the_end(group.abort_group)  # peers blocked on this rank in a collective fail now, not at the timeout
        e.__traceback__ = _from_the_script(e.__traceback__)
        raise
    finally:
        def restore() -> None:
            sys.argv = old_argv
            sys.path[:] = old_path

        _to_the_end(guard.remove, restore, _release)
    return True


def _release() -> None:
    if _run_lock.locked():  # idempotent: ``_to_the_end`` may run it again
        _run_lock.release()


def _to_the_end(*steps: Callable[[], object]) -> None:
    """Run each step (each safe to run again) to its end, even if a KeyboardInterrupt lands
    meanwhile.  The stop button interrupts every rank, and a rank whose script already
    failed (its peer's abort cut its collective short) gets its interrupt late, in this
    cleanup: a group left half aborted would be taken as a live one by the next run, whose
    ``init_process_group`` would then skip the rendezvous its peers wait in for good."""
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt:
                continue  # the script has stopped already: this interrupt has nothing left to stop


def _from_the_script(tb):
    """The traceback from the script's first frame on (without this runner's and runpy's)."""
    first = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb if tb is not None else first


class _GroupGuard:
    """While a script runs: its ``init_process_group()`` is a no-op when this rank already
    has a compatible default group (from ``setup_torch_distributed(procs)`` or an earlier
    run), and its ``destroy_process_group()`` keeps a group it did not make.  Without a
    group they are torch's own (the new group's connections noted, for ``abort_group``)."""

    def __init__(self):
        self.patched: list[tuple[object, str, object]] = []
        self.pre_existing = False

    def install(self) -> None:
        try:
            import torch.distributed as dist  # a torchrun script imports it anyway
        except ImportError:
            return
        if not dist.is_available():
            return
        self.pre_existing = dist.is_initialized()
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        real_init, real_destroy = c10d.init_process_group, c10d.destroy_process_group

        def init(backend, init_method, timeout, world_size, rank, *args, **kw):
            group.before_init()
            with group.recording_sockets():  # so that a failure elsewhere can cut this group short
                made = real_init(backend, init_method, timeout, world_size, rank, *args, **kw)
            group.made()
            return made

        def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kw):
            if not dist.is_initialized():
                return init(backend, init_method, timeout, world_size, rank, *args, **kw)
            have = dist.get_world_size(), dist.get_rank()
            if (world_size not in (-1, None) and world_size != have[0]) or (rank not in (-1, None) and rank != have[1]):
                raise RuntimeError(f"init_process_group(world_size={world_size}, rank={rank}): this rank already "
                                   f"has a group of world size {have[0]} in which it is rank {have[1]}")
            if backend is not None and not _same_backend(str(backend), str(dist.get_backend())):
                real_destroy()  # (the new group meets over the same store)
                return init(backend, init_method, timeout, world_size, rank, *args, **kw)
            return None  # already initialised, as the script wants

        def destroy_process_group(pg=None):
            if pg is None and self.pre_existing:
                return None  # the notebook's group outlives the script
            out = real_destroy(pg)
            if pg is None:
                group.gone()  # its store's keys are never met again
            return out

        for module in (dist, c10d):
            for name, fn in (("init_process_group", init_process_group),
                             ("destroy_process_group", destroy_process_group)):
                self.patched.append((module, name, getattr(module, name)))
                setattr(module, name, fn)

    def remove(self) -> None:
        for module, name, fn in reversed(self.patched):
            setattr(module, name, fn)
        self.patched = []


def _same_backend(wanted: str, have: str) -> bool:
    wanted, have = wanted.lower(), have.lower()
    if wanted == have:
        return True
    # "cpu:gloo,cuda:nccl" style: every backend asked for must be in the group's.
    parts = {p.split(":")[-1] for p in wanted.split(",")}
    return parts <= {p.split(":")[-1] for p in have.split(",")}
