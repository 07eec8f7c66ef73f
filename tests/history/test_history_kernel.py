"""The history from a notebook: a kernel writes it, is shut down, and a fresh kernel asks it
with ``%mesh history`` (a pandas DataFrame), plots a metric and lists it."""

from __future__ import annotations

import os
import time

import pytest
from jupyter_client.manager import KernelManager
from support.kernels import finished, iopub, kernel, run, started, text

pytestmark = pytest.mark.timeout(240)

CELL = """%%mesh
import monarch_kernel
for step in range(20):
    monarch_kernel.metric("loss", 1.0 / (step + 1) + monarch_kernel.current_rank().rank, step=step)
print("trained", monarch_kernel.current_rank().rank)
"""


def test_a_history_outlives_its_kernel_and_a_fresh_one_asks_it_in_sql(kernelspec, tmp_path):
    # no samples of the history's own (history_sample 0): those in it are %mesh top's
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist"), "MONARCH_KERNEL_HISTORY_FLUSH": "0.2",
           "MONARCH_KERNEL_HISTORY_SAMPLE": "0"}
    km, kc = started(lambda: KernelManager(kernel_name=kernelspec), env=env)
    try:
        out, reply = run(kc, "procs = %mesh spawn -n 2 --name trained")
        assert reply["status"] == "ok", text(out)
        out, reply = run(kc, CELL)
        assert reply["status"] == "ok" and "trained" in text(out), text(out)
        assert "metric" not in text(out)  # the metrics' control lines never show
        out, reply = run(kc, "%mesh top --count 3 --interval 0.2")
        assert reply["status"] == "ok", text(out)
        # a watchdog alarm, with the stacks it took, and an interrupt
        run(kc, "%mesh watchdog 1")
        out, reply = run(kc, "%%mesh\nimport time\ntime.sleep(4)")
        assert "%mesh watchdog: the cell has waited on trained" in text(out), text(out)
        msg_id = kc.execute("%%mesh\nimport time\ntime.sleep(60)")
        iopub(kc).wait("the cell to start on the ranks", lambda: any(
            m.content.get("execution_state") == "busy" for m in iopub(kc).of(msg_id, "status")), 30)
        time.sleep(1)  # the ranks are in the sleep
        km.interrupt_kernel()
        iopub(kc).wait_idle(msg_id, 60)
        pid = run(kc, "import os; print(os.getpid())").text.strip()
    finally:
        finished(km, kc)
    # that kernel is gone (its process waited for); a new one reads what it wrote
    with kernel(kernelspec, env=env) as kc:
        assert run(kc, "import os; print(os.getpid())").text.strip() != pid
        out, reply = run(kc, 'df = %mesh history --mesh trained "SELECT rank, count(*) AS n, min(value) AS low '
                             'FROM metrics WHERE name = \'loss\' GROUP BY rank ORDER BY rank"\n'
                             'print(type(df).__name__, df.to_dict("list"))')
        assert reply["status"] == "ok", text(out)
        assert text(out).strip() == "DataFrame {'rank': [0, 1], 'n': [20, 20], 'low': [0.05, 1.05]}"
        out, reply = run(kc, '%mesh history --mesh trained "SELECT rank, cell, line FROM lines ORDER BY rank"')
        shown = text(out)
        assert reply["status"] == "ok" and "trained 0" in shown and "trained 1" in shown, shown
        assert "Cell In[2]" in shown, shown  # the cell the lines belong to
        out, reply = run(kc, '%mesh history --mesh trained "SELECT kind, count(*) AS n FROM events '
                             'GROUP BY kind ORDER BY kind"\n')
        assert all(kind in text(out) for kind in ("spawn", "stop", "watchdog", "interrupt")), text(out)
        out, reply = run(kc, '%mesh history --mesh trained "SELECT DISTINCT rank, reason FROM stacks ORDER BY rank"')
        assert "watchdog" in text(out) and "1" in text(out), text(out)
        out, reply = run(kc, '%mesh history --mesh trained "SELECT rank, count(*) AS n, count(cpu) AS with_cpu, '
                             'min(rss_mib) > 1 AS rss FROM samples GROUP BY rank ORDER BY rank"\n')
        assert reply["status"] == "ok", text(out)
        assert [line.split()[1:] for line in text(out).strip().splitlines()[1:]] == [
            ["0", "3", "2", "True"], ["1", "3", "2", "True"]], text(out)  # %mesh top's: the first has no CPU yet
        out, reply = run(kc, "%mesh history --mesh trained --plot loss")
        assert reply["status"] == "ok", text(out)
        assert any("image/png" in o.data for o in out), [o.kind for o in out]
        out, reply = run(kc, "%mesh history --list")
        assert "trained" in text(out) and "ended" in text(out), text(out)
        out, reply = run(kc, '%mesh history --mesh trained "SELECT nope FROM lines"')
        assert reply["ename"] == "UsageError" and "nope" in reply["evalue"] and "--views" in reply["evalue"]
        out, reply = run(kc, "%mesh history --mesh other \"SELECT 1\"")
        assert reply["ename"] == "UsageError" and "no history named 'other'" in reply["evalue"]


def test_a_cell_run_again_is_a_new_run_and_the_magic_reads_the_kernels_own(kernelspec, tmp_path):
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist"), "MONARCH_KERNEL_HISTORY_FLUSH": "0.2"}
    spawn = "procs = %mesh spawn -n {n} --name again"
    say = "%%mesh\nimport monarch_kernel\nprint('{word}', monarch_kernel.current_rank().rank)"
    with kernel(kernelspec, env=env) as kc:
        for n, word in ((2, "first"), (1, "second")):  # the same cells run again: the mesh replaced
            out, reply = run(kc, spawn.format(n=n))
            assert reply["status"] == "ok", text(out)
            out, reply = run(kc, say.format(word=word))
            assert reply["status"] == "ok" and word in text(out), text(out)
        out, reply = run(kc, 'df = %mesh history "SELECT run, line FROM lines ORDER BY time"\n'
                             'print(df["line"].tolist(), df["run"].nunique())')
        assert reply["status"] == "ok" and text(out).strip() == "['second 0'] 1", text(out)
        out, reply = run(kc, "runs = %mesh history --list\nprint(runs[['name', 'ranks', 'state']].values.tolist())")
        assert text(out).strip() == "[['again', 1, 'running'], ['again', 2, 'ended']]", text(out)
        out, reply = run(kc, 'df = %mesh history --run all "SELECT run, count(*) AS n FROM lines GROUP BY run '
                             'ORDER BY run"\nprint(df["n"].tolist(), df["run"].tolist() == sorted(runs["run"]))')
        assert text(out).strip() == "[2, 1] True", text(out)
        out, reply = run(kc, 'old = runs["run"][1]\n'
                             'df = %mesh history --run $old "SELECT count(*) AS n FROM lines"\nprint(df["n"].tolist())')
        assert reply["status"] == "ok" and text(out).strip() == "[2]", text(out)
        out, reply = run(kc, '%mesh history --run nope "SELECT 1"')
        assert reply["ename"] == "UsageError" and "'again' has no run 'nope'" in reply["evalue"], reply
