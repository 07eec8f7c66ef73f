"""A failed cell aborts the cells queued behind it (Jupyter's ``stop_on_error``), and only
those: a cell sent after the failure's reply arrived runs, however soon it is sent."""

from __future__ import annotations

import pytest
from support.kernels import iopub, reply_to, run

pytestmark = pytest.mark.timeout(120)


SPIN = """
import threading
spinning = threading.Event(); spinning.set()
def _spin():
    while spinning.is_set():
        sum(range(1000))
threading.Thread(target=_spin, daemon=True).start()
"""


def test_a_cell_sent_as_soon_as_the_error_arrives_runs(kc):
    # A thread of the kernel's own that wants the GIL (as the mesh's IO and output threads
    # do): the kernel's main thread, sending a reply, loses the GIL for a while.
    assert run(kc, SPIN).reply["status"] == "ok"
    try:
        for i in range(30):  # each round: a failure, and the next cell at once
            outputs, reply = run(kc, f"raise ValueError('round {i}')")
            assert reply["status"] == "error" and reply["ename"] == "ValueError", reply
            outputs, reply = run(kc, f"print('after {i}')")
            assert reply["status"] == "ok", (i, reply)
            assert "".join(o.text for o in outputs) == f"after {i}\n", outputs
    finally:
        run(kc, "spinning.clear()")


def test_cells_queued_behind_a_failure_are_aborted_and_later_ones_run(kc):
    first = kc.execute("import time; time.sleep(0.5); raise RuntimeError('first')")
    queued = [kc.execute(f"print('queued {k}')") for k in range(2)]  # sent before the failure
    assert reply_to(kc, first, 60)["status"] == "error"
    for msg_id in queued:
        assert reply_to(kc, msg_id, 60)["status"] == "aborted"
        iopub(kc).wait_idle(msg_id, 60)
    outputs, reply = run(kc, "print('later')")
    assert reply["status"] == "ok" and "".join(o.text for o in outputs) == "later\n"
    # stop_on_error=False: nothing behind the failure is aborted
    first = kc.execute("raise RuntimeError('again')", stop_on_error=False)
    nxt = kc.execute("print('runs')")
    assert reply_to(kc, first, 60)["status"] == "error"
    assert reply_to(kc, nxt, 60)["status"] == "ok"
