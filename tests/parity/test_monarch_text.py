"""Monarch's wording where its users print or match on it: the ``ActorError`` string, the
``Point`` string, the ``Future()`` construction error and ``ValueMesh[int]``.  Our content
(rank, pid, host, traceback) is kept; only the framing is Monarch's."""

from __future__ import annotations

import asyncio
import re

import pytest

from monarch_kernel import ActorError, ActorMesh, Future, ValueMesh
from monarch_kernel.actor.shape import Extent, Point
from monarch_kernel.runtime.failure import RemoteFailure


@pytest.mark.timeout(10)
def test_point_prints_as_monarch_does():
    extent = Extent({"hosts": 2, "gpus": 4})
    p = Point.from_rank(5, extent)
    assert repr(p) == "{'hosts': 1/2, 'gpus': 1/4}"
    assert str(p) == repr(p) and f"{p}" == repr(p)
    assert repr(Point((), Extent({}))) == "{}"
    assert dict(p) == {"hosts": 1, "gpus": 1}


@pytest.mark.timeout(10)
def test_actor_error_leads_with_monarchs_line_then_says_where():
    tb = ('Traceback (most recent call last):\n  File "w.py", line 3, in step\n'
          '    raise ValueError("bad")\nValueError: bad\n')
    f = RemoteFailure(3, "trainer", "step", "ValueError", "bad", tb, "node7", 4242)
    assert str(ActorError(f)) == (
        "Actor call trainer.step failed.\n"
        " It raised on rank 3 (pid 4242 on node7): ValueError: bad\n"
        " Traceback of where the remote call failed (most recent call last):\n"
        '  File "w.py", line 3, in step\n    raise ValueError("bad")\nValueError: bad')
    no_tb = RemoteFailure(0, "trainer", "", "KeyError", "'x'", "", "node7", 1)
    assert str(ActorError(no_tb)).splitlines()[::2] == [
        "Actor call trainer failed.",
        " Traceback of where the remote call failed (most recent call last):"]


@pytest.mark.timeout(10)
def test_future_is_built_as_monarchs_is():
    # Before: "Future.__init__() missing 1 required keyword-only argument: 'coro'".
    with pytest.raises(TypeError, match=re.escape(
            "Future objects are returned by Monarch operations and cannot be constructed directly.")):
        Future()
    with pytest.raises(TypeError, match=re.escape(
            "Future.__init__() takes 1 positional argument but 2 were given")):
        Future(3)  # type: ignore[arg-type]

    async def answer() -> int:
        await asyncio.sleep(0.01)
        return 42

    # Before: a coroutine was wrapped and started at once; Monarch refuses the keyword.
    coro = answer()
    with pytest.raises(TypeError, match=re.escape("Future.__init__() got an unexpected keyword argument 'coro'")):
        Future(coro=coro)  # type: ignore[call-arg]
    coro.close()
    # Monarch's own tests build one with its private Future._from_coro, run once awaited or read.
    ran: list[str] = []

    async def noted() -> int:
        ran.append("ran")
        return await answer()

    fut = Future._from_coro(noted())
    assert not fut.done() and ran == []
    assert fut.get(timeout=5) == 42 and fut.get() == 42 and ran == ["ran"]

    async def awaited() -> int:
        return await Future._from_coro(answer())

    assert asyncio.run(awaited()) == 42

    async def fails() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        Future._from_coro(fails()).get(timeout=5)


@pytest.mark.timeout(10)
def test_generic_meshes_are_the_class_itself_at_run_time():
    # Before: typing's _GenericAlias, which isinstance() and some Monarch code refuse.
    assert ValueMesh[int] is ValueMesh and ActorMesh["Trainer"] is ActorMesh
