"""Actor classes that tests in several folders spawn (``Echo``, ``Counter``, ``Fragile``,
``Parent``...), and the helpers that wait on what they do.

They live in an importable module (not in a test's ``__main__``), so ranks import them by
reference, the way library code reaches ranks.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import psutil
import zmq

from monarch_kernel import Actor, context, current_rank, current_size, endpoint, this_host
from monarch_kernel.runtime.process import Runtime


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def stats(self) -> dict:
        return Runtime.current().stats()

    @endpoint
    def make_lock(self):
        return threading.Lock()

    @endpoint
    def fail_on(self, bad_rank: int, value):
        if current_rank().rank == bad_rank:
            raise ValueError(f"bad value {value!r} on rank {bad_rank}")
        return value * 10

    @endpoint
    def sleep(self, s: float) -> int:
        time.sleep(s)
        return current_rank().rank

    @endpoint
    async def nap(self, s: float, marker_dir: str | None = None) -> int:
        """Sleep ``s`` on the IO loop (so sync endpoints still run meanwhile); drops a
        marker file first so the test knows the endpoint is running."""
        rank = current_rank().rank
        if marker_dir is not None:
            with open(os.path.join(marker_dir, f"started.{rank}"), "w") as f:
                f.write(str(os.getpid()))
        await asyncio.sleep(s)
        return rank

    @endpoint
    async def nap_on(self, slow_rank: int, s: float, marker_dir: str) -> int:
        """Only ``slow_rank`` naps; the others answer at once.  It drops the marker
        ``started.R`` first, then ``held.R`` once the answers of every rank it forwarded the
        call to are held here (only its own part is missing), so a test can act after that."""
        rank = current_rank().rank
        if rank == slow_rank:
            with open(os.path.join(marker_dir, f"started.{rank}"), "w") as f:
                f.write(str(os.getpid()))
            deadline = time.monotonic() + 20
            while not _only_own_part_missing(rank):
                if time.monotonic() > deadline:
                    break  # no held.R: the test's wait for it says so
                await asyncio.sleep(0.01)
            else:
                with open(os.path.join(marker_dir, f"held.{rank}"), "w") as f:
                    f.write(str(os.getpid()))
            await asyncio.sleep(s)
        return rank

    @endpoint
    async def block_loop(self, s: float, marker_dir: str) -> None:
        """Blocks the rank's IO loop itself, so it cannot even read a STOP."""
        with open(os.path.join(marker_dir, f"blocked.{current_rank().rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(s)

    @endpoint
    def raise_unpicklable(self) -> None:
        raise LockedError("holds a lock")

    @endpoint
    def raise_unprintable(self) -> None:
        raise UnprintableError()

    @endpoint
    def exit_with(self, code: int, message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        os._exit(code)

    @endpoint
    def chatter(self, tag: str) -> int:
        rank = current_rank().rank
        print(f"{tag} print from rank {rank}", flush=True)
        print(f"{tag} stderr from rank {rank}", file=sys.stderr, flush=True)
        os.write(1, f"{tag} os.write from rank {rank}\n".encode())
        subprocess.run(["echo", f"{tag} child process of rank {rank}"], check=True)
        return rank

    @endpoint
    def modules(self) -> dict:
        main = sys.modules.get("__main__")
        return {"torch": "torch" in sys.modules, "main_file": getattr(main, "__file__", None)}


class Talker(Actor):
    """Prints ``n`` lines and records ``n`` points of ``loss``, as a training loop would (the
    history's tests on other hosts); answers with its host's name."""

    @endpoint
    def talk(self, n: int) -> str:
        import socket

        import monarch_kernel as mk

        r = mk.current_rank().rank
        for i in range(n):
            print(f"rank {r} says {i}")
            mk.metric("loss", 1.0 / (i + 1), step=i)
        return socket.gethostname()


class Hog(Actor):
    """Takes memory on purpose (the OOM tests, under a cgroup's limit)."""

    def __init__(self):
        self.held: list[bytes] = []

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def grab(self, mib: int, step_mib: int = 8) -> int:
        for _ in range(0, mib, step_mib):
            self.held.append(b"\x01" * (step_mib << 20))  # written, so every page is charged
        return len(self.held) * step_mib


class Sleepy(Actor):
    """Sleeps on purpose (the hang watchdog's tests): ``nap(rank, s)`` naps ``s`` seconds on
    ``rank`` (every rank for -1) in short steps, so an interrupt lands at once."""

    @endpoint
    def nap(self, rank: int, seconds: float) -> int:
        me = current_rank().rank
        if rank in (-1, me):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(0.05)
        return me


class Counter(Actor):
    def __init__(self, start: int):
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    async def get(self) -> int:
        await asyncio.sleep(0)
        return self.value

    @endpoint
    def where(self) -> tuple:
        p = current_rank()
        return p.rank, dict(p), current_size(), context().message_rank.rank

    @endpoint
    def slow(self, s: float) -> int:
        time.sleep(s)
        return current_rank().rank


class Fragile(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def poke(self, fail: bool) -> int:
        self.calls += 1
        if fail:
            raise RuntimeError(f"poked to death after {self.calls} calls")
        return self.calls


def _only_own_part_missing(rank: int) -> bool:
    """Whether a call this rank forwards waits only for this rank's own answer (its
    subtrees have all answered to it)."""
    return any(st.waiting == {rank} for st in list(Runtime.current().server.gathering.nodes.active.values()))


class LockedError(Exception):
    """An exception that cannot be pickled (it carries a lock)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()


class UnprintableError(Exception):
    """An exception whose ``str()`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("no words for it")


class BadInit(Actor):
    def __init__(self, reason: str):
        self.reason = reason
        raise KeyError(f"cannot start actor: {reason}")  # the line the test looks for

    @endpoint
    def echo(self, x):
        return x


class Parent(Actor):
    """Spawns a child mesh of its own.  ``handle`` decides what ``__supervise__`` does:
    "handle" (returns True), "decline" (returns False), "raise"; None: no handler at all
    (see ``UnsupervisedParent``)."""

    def __init__(self, handle: str = "handle"):
        self.handle = handle
        self.seen: list[str] = []
        self.children = None
        self.child_procs = None

    def __supervise__(self, failure):
        self.seen.append(failure.report())
        if self.handle == "raise":
            raise RuntimeError("supervisor broke")
        return self.handle == "handle"

    @endpoint
    def start_children(self, n: int = 2) -> list[int]:
        self.child_procs = this_host().spawn_procs(per_host={"g": n}, name="child")
        self.children = self.child_procs.spawn("kids", Echo)
        return list(self.children.pid.call().get(timeout=30).values())

    @endpoint
    def kill_child(self, rank: int) -> int:
        pid = self.children.slice(g=rank).pid.call_one().get(timeout=30)
        os.kill(pid, 9)
        return pid

    @endpoint
    def wait_seen(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while not self.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.seen)

    @endpoint
    def seen_now(self) -> list[str]:
        return list(self.seen)

    @endpoint
    def stop_children(self) -> None:
        if self.child_procs is not None:
            self.child_procs.stop().get(timeout=20)


class UnsupervisedParent(Parent):
    __supervise__ = None  # getattr(..., "__supervise__") finds None: no handler


# ---------------------------------------------------------------- helpers


def inject(address: str, *messages: list) -> None:
    """Send raw multipart messages to a ZeroMQ inbox, as any local process could."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(address)
        for frames in messages:
            s.send_multipart(frames)
        s.close(linger=10_000)  # blocks until delivered (or 10 s)
    finally:
        ctx.term()


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(predicate, timeout: float, what: str) -> None:
    """Wait for ``predicate`` to hold; fail saying what was waited for when it never does."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def alive(pids) -> list[int]:
    """The pids still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait until every pid has exited; returns those still alive at the deadline."""
    wait_for(lambda: not alive(pids), timeout)
    return alive(pids)


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
