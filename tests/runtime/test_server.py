"""The server that hosts actors, on ranks and in the controller: an interrupt reaches the
endpoint a hosted actor is running (a blocking sleep or queue wait alike) and the actor serves
the next call with its state kept; the controller's own process hosts actors too."""

from __future__ import annotations

import time

import pytest
from support.actors import Counter, wait_until

from monarch_kernel import this_host, this_proc
from monarch_kernel.console.console import Console
from monarch_kernel.runtime.errors import ActorError

pytestmark = pytest.mark.timeout(90)


def test_interrupt_cuts_a_blocking_call_short(tmp_path):
    # Before: the rank's time.sleep(60) ran on; the interrupt landed only when it returned.
    with this_host().spawn_procs(per_host={"r": 2}) as procs:
        consoles = procs.spawn("console", Console)
        consoles.run.call("import os, queue, time\nq = queue.Queue()", "<t>", "a").get(timeout=20)
        for n, code in enumerate(("time.sleep(60)", "q.get()")):
            mark = tmp_path / f"started{n}"
            fut = consoles.run.call(f"started = time.time()\nopen({str(mark)!r} + str(os.getpid()), 'w').close()\n"
                                    f"{code}", "<t>", "b")
            wait_until(lambda n=n: len(list(tmp_path.glob(f"started{n}*"))) == 2, 10, "the cell to start on both ranks")
            t0 = time.monotonic()
            procs.interrupt(consoles)
            with pytest.raises(ActorError) as info:
                fut.get(timeout=5)
            assert time.monotonic() - t0 < 1.5, f"{code}: the interrupt took {time.monotonic() - t0:.1f} s"
            assert "KeyboardInterrupt" in str(info.value)
        # The namespace is kept, and the console serves the next cell at once.
        value = consoles.run.call("time.time() - started < 10", "<t>", "c").get(timeout=5)
        assert [v["value"] for v in value.values()] == ["True", "True"]


@pytest.mark.timeout(60)
def test_this_proc_hosts_actor_in_calling_process():
    c = this_proc().spawn("local", Counter, 5)
    assert c.incr.call_one(1).get(timeout=10) == 6
    assert c.extent == {}
