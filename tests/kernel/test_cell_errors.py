"""What a ``%%mesh`` cell shows when it fails, is interrupted or runs long, through a real
kernel and four real ranks: a failure the same on every rank once, different failures per
group, a syntax error found before the cell reaches the ranks, an interrupt as one line per
place the ranks were stopped with none of the kernel's frames, and a progress line that
ticks each second in one display and is emptied at the end.  The syntax check's own rules
(IPython syntax passes; line numbers as the ranks count them) are checked without a kernel."""

from __future__ import annotations

import re

import pytest
from support.kernels import iopub, reply_to, run, text

from monarch_kernel.kernel.cell_errors import CellSyntaxError, check_syntax
from monarch_kernel.runtime.rank_sets import parse_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mesh_kc(module_kc):
    """The module's kernel, with a mesh of four ranks."""
    out, reply = run(module_kc, "procs = %mesh spawn -n 4")
    assert reply["status"] == "ok", text(out)
    return module_kc


def printed_by(shown: str, line: str) -> set[int]:
    """The ranks whose output has ``line``, collapsed (``[ranks 0-3] line``) or not."""
    ranks: set[int] = set()
    for label in re.findall(rf"^\[ranks? ([0-9,-]+)\] {re.escape(line)}$", shown, re.M):
        ranks.update(parse_ranks(label, 1 << 20))
    return ranks


def errors(out) -> list[str]:
    return [o.text for o in out if o.kind == "error"]


def test_the_same_failure_on_every_rank_shows_once(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\n1/0")
    assert reply["status"] == "error"
    assert (reply["ename"], reply["evalue"]) == ("ZeroDivisionError", "division by zero")
    [shown] = errors(out)
    assert shown.startswith("[ranks 0-3] ZeroDivisionError: division by zero\nTraceback (most recent call last):\n")
    assert shown.count("Traceback") == 1 and shown.count("    1/0\n") == 1, shown
    assert shown.endswith("\nZeroDivisionError: division by zero"), shown
    assert "[rank 0]" not in shown and "[rank 3]" not in shown


def test_a_traceback_names_notebook_cells_as_ipython_does(mesh_kc):
    """``Cell In[N], line L`` (``, in f`` inside a function), for the %%mesh cell and for a
    function an earlier plain cell defined, never the file ipykernel compiled the cell under."""
    out, reply = run(mesh_kc, "def halve(x):\n    return x / 0")
    assert reply["status"] == "ok", text(out)
    defined = reply["execution_count"]
    out, reply = run(mesh_kc, "%mesh push halve=halve")  # sent by value: its code keeps its cell's file
    assert reply["status"] == "ok", text(out)
    out, reply = run(mesh_kc, "%%mesh\ndef f():\n    return halve(1)\nf()")
    [shown] = errors(out)
    n = reply["execution_count"]
    assert f"\n  Cell In[{n}], line 4\n    f()\n" in shown, shown
    assert f"\n  Cell In[{n}], line 3, in f\n    return halve(1)\n" in shown, shown
    assert f"\n  Cell In[{defined}], line 2, in halve\n    return x / 0\n" in shown, shown
    assert "ipykernel_" not in shown and 'File "' not in shown, shown


def test_different_failures_show_per_group_and_the_reply_names_the_first(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\nfrom monarch_kernel import current_rank\nr = current_rank().rank\n"
                              "if r % 2:\n    raise ValueError(f'odd rank {r}')\n1/0")
    assert reply["status"] == "error"
    assert (reply["ename"], reply["evalue"]) == ("ZeroDivisionError", "division by zero")  # rank 0's
    [shown] = errors(out)
    heads = [line for line in shown.splitlines() if line.startswith("[")]
    assert heads == ["[ranks 0,2] ZeroDivisionError: division by zero", "[rank 1] ValueError: odd rank 1",
                     "[rank 3] ValueError: odd rank 3"], shown
    assert shown.count("Traceback") == 3, shown


def test_a_syntax_error_shows_once_and_never_reaches_the_ranks(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\n# sentinel_syntax_7\nx = 1\nif x\n    pass")
    assert reply["status"] == "error"
    assert reply["ename"] == "SyntaxError" and reply["evalue"].startswith("expected ':'")
    [shown] = errors(out)
    n = reply["execution_count"]  # named as IPython names the cell, line 1 being %%mesh
    assert shown == f"  Cell In[{n}], line 4\n    if x\n        ^\nSyntaxError: expected ':'", shown
    assert "[rank" not in text(out)
    # A cell that reached a rank is in its linecache (tracebacks quote it): this one is not.
    out, reply = run(mesh_kc, "%%mesh\nimport linecache\nmark = 'sentinel_' + 'syntax_7'\n"
                              "any(mark in ''.join(v[2]) for v in list(linecache.cache.values()))")
    assert reply["status"] == "ok", text(out)
    assert "[ranks 0-3] False" in text(out), text(out)


def test_an_interrupt_shows_where_each_group_of_ranks_was(mesh_kc):
    cell = ("%%mesh\nimport time\nfrom monarch_kernel import current_rank\ndef wait():\n    time.sleep(60)\n"
            "print('waiting', flush=True)\nwait() if current_rank().rank % 2 else time.sleep(60)")
    msg_id = mesh_kc.execute(cell)
    collector = iopub(mesh_kc)
    # Every rank printed the line just before its sleep: by the time it has come through the kernel, they sleep.
    collector.wait("every rank to print 'waiting'", lambda: printed_by(text(collector.outputs(msg_id)), "waiting")
                   == {0, 1, 2, 3}, 60, collector.so_far(msg_id))
    mesh_kc.parent.interrupt_kernel()
    reply = reply_to(mesh_kc, msg_id, 30)
    out = collector.wait_idle(msg_id)
    assert reply["ename"] == "KeyboardInterrupt"
    [shown] = errors(out)
    assert shown == ("KeyboardInterrupt: interrupted on ranks 0-3; their namespaces are kept\n"
                     "[ranks 0,2] interrupted at cell line 7: wait() if current_rank().rank % 2 else time.sleep(60)\n"
                     "[ranks 1,3] interrupted at cell line 5 in wait: time.sleep(60)"), shown
    assert "magics.py" not in shown and "mesh_cell.py" not in shown and "Traceback" not in shown
    out, reply = run(mesh_kc, "%%mesh\ncallable(wait)")  # the namespaces are kept
    assert "[ranks 0-3] True" in text(out), text(out)


def test_the_progress_line_ticks_each_second_as_the_cells_last_line(mesh_kc):
    msg_id = mesh_kc.execute("%%mesh\nimport time\ntime.sleep(5)")
    collector = iopub(mesh_kc)
    collector.wait_idle(msg_id, timeout=60)
    assert not collector.of(msg_id, "display_data", "update_display_data"), "the progress line is no display"
    ticks = [m.content["text"] for m in collector.of(msg_id, "stream")]
    # A loaded machine may end some ranks' sleep a second before others': the line then says so.
    lines = [re.fullmatch(r"\r?\[mesh\] ([0-3]) of 4 ranks finished \((\d+) s\) *", t) for t in ticks[:-1]]
    assert all(lines), ticks
    shown = [(int(m.group(2)), int(m.group(1))) for m in lines]
    seconds = [s for s, _ in shown]
    assert seconds[0] == 2 and len(set(seconds)) >= 3, ticks  # shown at 2 s, then redrawn at least twice
    assert shown == sorted(set(shown)), f"each update a later second or more ranks finished: {ticks}"
    assert [n for _, n in shown] == sorted(n for _, n in shown), ticks
    # A cell that showed nothing else keeps the line as it ended.
    kept = text(collector.outputs(msg_id)).replace(" \n", "\n")
    assert re.fullmatch(r"\[mesh\] 4 of 4 ranks finished \(\d+ s\)\n", kept), kept


# ---------------------------------------------------------------- the syntax check alone


@pytest.mark.parametrize("body", ["!ls\nx = 1", "x?", "%timeit 1", "%%time\nx = 1", "%%writefile f.txt\nnot python",
                                  "await x", "files = !ls"])
def test_ipython_syntax_passes_the_check(body):
    check_syntax(body, "/tmp/cell.py", 1)


@pytest.mark.parametrize("body, lineno, ename", [
    ("x = 1\nif x\n    pass", 3, "SyntaxError"),
    ("!ls\nfor i in x:\n    pass\nbreak", 5, "SyntaxError"),  # found by the compiler, not the parser
    ("def f():\n    return\n        x", 4, "IndentationError"),
])
def test_a_syntax_error_has_the_cells_line_number_and_type(body, lineno, ename):
    with pytest.raises(CellSyntaxError) as info:
        check_syntax(body, "/tmp/cell.py", 1, "Cell In[3]")
    assert type(info.value).__name__ == ename and info.value.error.lineno == lineno
    assert info.value.error.filename == "/tmp/cell.py"
    shown = info.value._render_traceback_()
    assert shown[0] == f"  Cell In[3], line {lineno}"
    assert shown[1].strip() == (body.splitlines()[lineno - 2]).strip()
