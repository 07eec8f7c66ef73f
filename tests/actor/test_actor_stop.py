"""Stopping actors, as in Monarch: ``ActorMesh.stop()`` stops the actors but not their
processes; ``__cleanup__(exc)`` runs when an actor mesh or its procs stop; stopping cancels
an actor's running concurrent endpoints first; ``context().actor_instance.abort(reason)``
fails the actor and its owner hears; a rank whose procs stop normally runs its ``atexit``
handlers and its modules' finalizers.  Every test uses real ranks and looks at marker files
or values from the controller."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time

import pytest
from support.actors import wait_for

import monarch_kernel
from monarch_kernel import Actor, ActorError, context, endpoint, this_host

pytestmark = pytest.mark.timeout(90)


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


class Kept(Actor):
    """Writes ``<tag> <rank>`` lines to a file from its endpoints and ``__cleanup__``."""

    def __init__(self, log: str):
        self.log = log
        self.rank = int(context().actor_instance.rank.rank)

    def _say(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{what}:{self.rank}\n")

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint(concurrent=True)
    async def wait_forever(self) -> None:
        self._say("started")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self._say("cancelled")
            raise

    def __cleanup__(self, exc) -> None:
        self._say(f"cleanup-{type(exc).__name__}")


class AsyncKept(Kept):
    async def __cleanup__(self, exc) -> None:
        await asyncio.sleep(0)
        self._say("async-cleanup")


class BadCleanup(Actor):
    @endpoint
    def ping(self) -> int:
        return 1

    def __cleanup__(self, exc) -> None:
        raise RuntimeError("cleanup broke on purpose")


class HungCleanup(Actor):
    @endpoint
    def ping(self) -> int:
        return 1

    def __cleanup__(self, exc) -> None:
        time.sleep(3600)


class Aborter(Actor):
    @endpoint
    def give_up(self, reason: str) -> str:
        context().actor_instance.abort(reason)
        return "went on"

    @endpoint
    def ping(self) -> int:
        return 1


class Importer(Actor):
    @endpoint
    def load(self, name: str) -> str:
        return importlib.import_module(name).__name__


def test_actor_mesh_stop_stops_the_actors_not_their_processes(tmp_path):
    log = str(tmp_path / "log")
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        kept = procs.spawn("kept", Kept, log)
        other = procs.spawn("other", Kept, str(tmp_path / "other"))
        pids = list(kept.pid.call().get(timeout=30))
        assert kept.stop().get(timeout=20) is None
        assert sorted(_lines(log)) == ["cleanup-NoneType:0", "cleanup-NoneType:1"]
        with pytest.raises(ActorError, match=r"Actor Kept 'kept-\w+' on rank 0 of mesh .* is stopped"):
            kept.slice(r=0).pid.call_one().get(timeout=20)
        # The processes live on, and so do their other actors.
        assert list(other.pid.call().get(timeout=30)) == pids
        assert asyncio.run(_await(kept.stop())) is None  # awaitable, and stopping twice is fine


def test_stop_reaches_every_rank_through_the_tree(tmp_path):
    log = str(tmp_path / "log")
    with this_host().spawn_procs(per_host={"r": 12}) as procs:  # more ranks than the fanout (8)
        kept = procs.spawn("kept", Kept, log)
        kept.stop().get(timeout=30)
        assert sorted(_lines(log)) == sorted(f"cleanup-NoneType:{r}" for r in range(12))
        with pytest.raises(ActorError) as info:
            kept.pid.call().get(timeout=30)
        first = str(info.value).splitlines()
        assert first[0] == "Actor call kept failed."  # the name it was spawned with, as Monarch says it
        assert "ActorMesh.stop() stopped it. Spawn it again to call it." in first[1]


async def _await(fut):
    return await fut


def test_stop_cancels_running_concurrent_endpoints_before_cleanup(tmp_path):
    log = str(tmp_path / "log")
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        kept = procs.spawn("kept", Kept, log)
        waiting = kept.wait_forever.call_one()
        wait_for(lambda: os.path.exists(log) and "started:0" in _lines(log), timeout=20)
        kept.stop().get(timeout=20)
        assert _lines(log) == ["started:0", "cancelled:0", "cleanup-NoneType:0"]
        with pytest.raises(ActorError, match="CancelledError"):
            waiting.get(timeout=20)


def test_cleanup_runs_when_the_procs_stop(tmp_path):
    log = str(tmp_path / "log")
    procs = this_host().spawn_procs(per_host={"r": 2})
    try:
        procs.spawn("sync", Kept, log).initialized().get(timeout=30)
        procs.spawn("async", AsyncKept, log).initialized().get(timeout=30)
    finally:
        procs.stop().get(timeout=20)
    assert sorted(_lines(log)) == ["async-cleanup:0", "async-cleanup:1", "cleanup-NoneType:0", "cleanup-NoneType:1"]


def test_a_cleanup_that_raises_or_hangs_never_hangs_the_stop(capfd):
    with this_host().spawn_procs(per_host={"r": 1}) as procs:
        bad = procs.spawn("bad", BadCleanup)
        assert bad.ping.call_one().get(timeout=30) == 1
        bad.stop().get(timeout=20)
        with pytest.raises(ActorError, match="is stopped"):
            bad.ping.call_one().get(timeout=20)
        err: list[str] = []
        # Reported on the rank's stderr, which reaches the controller's.
        wait_for(lambda: err.append(capfd.readouterr().err) or "cleanup broke on purpose" in "".join(err),
                 timeout=20)
        assert "__cleanup__ of BadCleanup 'bad-" in "".join(err)
    procs = this_host().spawn_procs(per_host={"r": 1})
    hung = procs.spawn("hung", HungCleanup)
    assert hung.ping.call_one().get(timeout=30) == 1
    start = time.monotonic()
    procs.stop().get(timeout=20)
    assert time.monotonic() - start < 10


def test_abort_fails_the_actor_and_its_owner_hears(monkeypatch):
    events = []
    monkeypatch.setattr(monarch_kernel, "unhandled_fault_hook", events.append)
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        aborter = procs.spawn("aborter", Aborter)
        assert aborter.slice(r=1).give_up.call_one("out of patience").get(timeout=30) == "went on"
        wait_for(lambda: events, timeout=20)
        assert len(events) == 1 and events[0].rank == 1
        assert "aborted: out of patience" in events[0].report()
        with pytest.raises(ActorError, match="aborted: out of patience"):
            aborter.slice(r=1).ping.call_one().get(timeout=20)
        assert aborter.slice(r=0).ping.call_one().get(timeout=20) == 1


FINALIZED_MODULE = '''
import atexit, os

MARKERS = {markers!r}


def _at_exit():
    with open(os.path.join(MARKERS, "atexit"), "w") as f:
        f.write(str(os.getpid()))


atexit.register(_at_exit)


class Finalized:
    def __del__(self):
        with open(os.path.join(MARKERS, "del"), "w") as f:
            f.write(str(os.getpid()))


KEPT = Finalized()
'''


def test_ranks_run_atexit_and_module_finalizers_when_procs_stop(tmp_path, monkeypatch):
    markers = tmp_path / "markers"
    markers.mkdir()
    (tmp_path / "finalized_mod.py").write_text(FINALIZED_MODULE.format(markers=str(markers)))
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks inherit the controller's sys.path
    procs = this_host().spawn_procs(per_host={"r": 1})
    try:
        importer = procs.spawn("importer", Importer)
        assert importer.load.call_one("finalized_mod").get(timeout=30) == "finalized_mod"
    finally:
        procs.stop().get(timeout=20)
    sys.modules.pop("finalized_mod", None)
    assert sorted(os.listdir(markers)) == ["atexit", "del"]


HUNG_ATEXIT_MODULE = """
import atexit, time

atexit.register(time.sleep, 3600)
"""


def test_a_hung_exit_handler_is_still_ended_by_the_stop_grace(tmp_path, monkeypatch):
    (tmp_path / "hung_atexit_mod.py").write_text(HUNG_ATEXIT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    procs = this_host().spawn_procs(per_host={"r": 1})
    try:
        importer = procs.spawn("importer", Importer)
        assert importer.load.call_one("hung_atexit_mod").get(timeout=30) == "hung_atexit_mod"
    finally:
        start = time.monotonic()
        procs.stop().get(timeout=20)
    assert time.monotonic() - start < 10
    sys.modules.pop("hung_atexit_mod", None)
