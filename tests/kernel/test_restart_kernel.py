"""The restart policy through a real monarch kernel (issue 44 point 1): ``%mesh spawn
--restart on-failure``, a rank SIGKILLed while a cell runs is replaced by itself with a fresh
console, the cell shows one line for it, ``%mesh policy`` lists it, the run's history holds it,
and ``%mesh watchdog --then restart`` refuses a mesh without a policy, saying what to type."""

from __future__ import annotations

import os
import re
import signal

import pytest
from jupyter_client.manager import KernelManager
from support.kernels import finished, iopub, run, started, text

pytestmark = pytest.mark.timeout(240)


def _pids(kc) -> list[int]:
    out, _reply = run(kc, "print([r['pid'] for r in procs.rank_states()])")
    return [int(p) for p in re.findall(r"\d+", text(out))]


def test_a_killed_rank_is_replaced_and_the_cell_panel_and_history_say_so(kernelspec, tmp_path):
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist"), "MONARCH_KERNEL_HISTORY_FLUSH": "0.2"}
    km, kc = started(lambda: KernelManager(kernel_name=kernelspec), env=env)
    try:
        out, reply = run(kc, "plain = %mesh spawn -n 1 --name plain", timeout=120)
        assert reply["status"] == "ok", text(out)
        out, reply = run(kc, "%mesh watchdog 5 --then restart")
        assert reply["ename"] == "UsageError", reply
        assert "needs a restart policy on mesh plain" in reply["evalue"], reply
        assert "%mesh policy --restart on-failure" in reply["evalue"], reply
        out, reply = run(kc, "procs = %mesh spawn -n 2 --restart on-failure --max-restarts 2", timeout=120)
        assert reply["status"] == "ok", text(out)
        assert "restart policy: on-failure, at most 2 restarts within 600 s" in text(out), text(out)
        out, reply = run(kc, "%%mesh\nx = 41")
        assert reply["status"] == "ok", text(out)
        pids = _pids(kc)
        msg_id = kc.execute("event = procs.wait_restart(after=0, timeout=90)")
        io = iopub(kc)
        io.wait("the cell to start", lambda: any(m.content.get("execution_state") == "busy"
                                                 for m in io.of(msg_id, "status")), 30)
        os.kill(pids[1], signal.SIGKILL)
        got = text(io.wait_idle(msg_id, 120))
        assert re.search(r"\[procs\] rank 1 was killed by signal 9 \(SIGKILL\): restarted in \d+\.\d\d s "
                         r"\(pid \d+\), restart 1 in the window", got), got
        out, reply = run(kc, "%mesh policy")
        shown = text(out)
        assert "mesh procs: restart on-failure, at most 2 restarts within 600 s (1 in the window now)" in shown, shown
        assert "rank 1 was killed by signal 9 (SIGKILL): restarted in" in shown, shown
        # the replacement has a fresh console; the survivor kept its namespace
        out, reply = run(kc, "%%mesh\nprint(globals().get('x', 'fresh'))")
        assert "[rank 0] 41" in text(out) and "[rank 1] fresh" in text(out), text(out)
        out, reply = run(kc, "from monarch_kernel.kernel import load_magics\n"
                             "print([x for x in load_magics(get_ipython()).session.panel.log.lines('procs') "
                             "if x[2] == 'event'])")
        assert "restarted in" in text(out), text(out)
        out, reply = run(kc, '%mesh history --mesh procs "SELECT rank, kind FROM events WHERE kind = \'restart\'"')
        assert reply["status"] == "ok" and "restart" in text(out), text(out)
        out, reply = run(kc, "%mesh policy --restart never")
        assert "mesh procs: restart never" in text(out), text(out)
    finally:
        finished(km, kc)
