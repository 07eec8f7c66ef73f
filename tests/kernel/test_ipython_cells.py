"""A ``%%mesh`` cell is an IPython cell on every rank, seen through a real kernel as a
notebook sees it: ``!cmd`` output streamed and collapsed across ranks, line and cell magics,
``x?`` answered by the rank, ``get_ipython()`` and ``Out``, ``%debug`` after a failure in
the mesh's pdb, and ``%pip`` run once per host, not once per rank."""

from __future__ import annotations

import os
import queue
import re

import pytest
from support.kernels import ANSI, iopub, run, said_by, text

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mesh_kc(module_kc):
    """The module's kernel, with a mesh of four ranks on this host."""
    out, reply = run(module_kc, "procs = %mesh spawn -n 4", timeout=120)
    assert reply["status"] == "ok", text(out)
    return module_kc


PROGRESS = re.compile(r"\[mesh\] \d+ of \d+ ranks? finished \(\d+ s\)")


def cell(kc, code: str, timeout: float = 60) -> str:
    """Run a cell that must succeed; its output as the reader sees it (colours removed)."""
    out, reply = run(kc, code, timeout)
    shown = ANSI.sub("", text(out))
    assert reply["status"] == "ok", shown
    return PROGRESS.sub("", shown)  # the ticking progress line of a slow cell is not the cell's output


@pytest.mark.timeout(120)
def test_shell_commands_stream_per_rank_and_collapse(mesh_kc):
    out = cell(mesh_kc, "%%mesh\nfrom monarch_kernel import current_rank\nme = current_rank().rank\n"
                        "!echo hi from the shell\n!echo to stderr >&2\n!echo rank {me}\nlisted = !echo a b\nlisted")
    assert said_by(out, "hi from the shell") == [0, 1, 2, 3], out  # once each, collapsed where they came together
    assert said_by(out, "to stderr") == [0, 1, 2, 3], out
    for r in range(4):
        assert f"[rank {r}] rank {r}\n" in out, out  # {me} expanded in each rank's own namespace
    assert "[ranks 0-3] ['a b']" in out, out
    out = cell(mesh_kc, "%%mesh\n!exit 3\n_exit_code")
    assert "[ranks 0-3] 3" in out, out
    out = cell(mesh_kc, "%%mesh\n!!echo twice")
    assert "[ranks 0-3] ['twice']" in out, out


@pytest.mark.timeout(120)
def test_line_numbers_stay_the_cells_around_ipython_lines(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh --ranks 0\n!true\n%env MK_UNUSED=1\nx = 1\n1 / (x - x)")
    shown = ANSI.sub("", text(out))
    assert reply["status"] == "error", shown
    assert "line 5" in shown and "1 / (x - x)" in shown and "ZeroDivisionError" in shown, shown
    out, reply = run(mesh_kc, "%%mesh --ranks 0\n!true\nx = (")
    shown = ANSI.sub("", text(out))
    assert reply["status"] == "error" and "SyntaxError" in shown, shown
    assert "ast.py" not in shown and "line 3" in shown, shown


@pytest.mark.timeout(120)
def test_line_and_cell_magics_run_on_every_rank(mesh_kc, tmp_path):
    out = cell(mesh_kc, "%%mesh\n%env MK_IPY_FLAVOUR=plum\n%time total = sum(range(1000))\n"
                        "%timeit -n 3 -r 1 sum(range(10))")
    assert said_by(out, "env: MK_IPY_FLAVOUR=plum") == [0, 1, 2, 3], out
    assert len(re.findall(r"\[rank \d\] Wall time:|\[ranks [\d,-]+\] Wall time:", out)) >= 1, out
    assert sum(len(m) for m in re.findall(r"\[ranks? ([\d,-]+)\] [\d.]+ .s ± .* per loop", out)) >= 1, out
    out = cell(mesh_kc, "%%mesh\nimport os\nos.environ['MK_IPY_FLAVOUR'], total")
    assert "[ranks 0-3] ('plum', 499500)" in out, out
    out = cell(mesh_kc, "%%mesh\n%who")
    lines = out.strip().splitlines()  # other tests' names may differ by rank: every line has total
    assert lines and all(re.match(r"\[ranks? [\d,-]+\] .*\btotal\b", line) for line in lines), out
    # %%writefile on each rank (its own file: {me} is the rank's), then %run of it there.
    cell(mesh_kc, f"%%mesh\nfrom monarch_kernel import current_rank\nme = current_rank().rank\n"
                  f"where = {str(tmp_path)!r}")
    out = cell(mesh_kc, "%%mesh\n%%writefile {where}/script_{me}.py\nprint('script ran with', 6 * 7)\n")
    assert sorted(os.listdir(tmp_path)) == [f"script_{r}.py" for r in range(4)], out
    out = cell(mesh_kc, "%%mesh\n%run {where}/script_{me}.py")
    assert said_by(out, "script ran with 42") == [0, 1, 2, 3], out


@pytest.mark.timeout(120)
def test_help_is_answered_by_the_rank(mesh_kc):
    cell(mesh_kc, '%%mesh\ndef only_on_ranks(n):\n    "Doubles n, on a rank."\n    return 2 * n')
    # The same answer on every rank is one block under one label, as ipykernel shows it, not a label a line.
    out = cell(mesh_kc, "%%mesh\nonly_on_ranks?")
    assert out.startswith("[ranks 0-3]\n") and out.count("[rank") == 1, out
    assert "\nDocstring: Doubles n, on a rank." in out, out
    out = cell(mesh_kc, "%%mesh\nonly_on_ranks??")
    assert "\ndef only_on_ranks(n):" in out and "\n    return 2 * n" in out and out.count("[rank") == 1, out
    out = cell(mesh_kc, "%%mesh\n?len")
    assert "\nSignature: len(obj, /)" in out and out.count("[rank") == 1, out
    out, reply = run(mesh_kc, "only_on_ranks")  # the kernel itself has no such name
    assert reply["status"] == "error", text(out)


@pytest.mark.timeout(120)
def test_get_ipython_and_output_history_on_the_rank(mesh_kc):
    out = cell(mesh_kc, "%%mesh\nget_ipython().__class__.__name__")
    assert "[ranks 0-3] 'RankShell'" in out, out
    cell(mesh_kc, "%%mesh\n6 * 7")
    out = cell(mesh_kc, "%%mesh\n_ + 1")
    assert "[ranks 0-3] 43" in out, out
    out = cell(mesh_kc, "%%mesh\n__, 42 in Out.values(), 43 in Out.values()")
    assert "[ranks 0-3] (42, True, True)" in out, out
    out = cell(mesh_kc, "%%mesh\n99;")  # a trailing semicolon: run, not shown
    assert "99" not in out, out


@pytest.mark.timeout(150)
def test_matplotlib_inline_and_autoreload(mesh_kc, tmp_path):
    out, reply = run(mesh_kc, "%%mesh --ranks 0-1\n%matplotlib inline\nimport matplotlib.pyplot as plt\n"
                              "plt.plot([1, 2, 3])\nNone", timeout=120)
    assert reply["status"] == "ok", text(out)
    pngs = [o for o in out if "image/png" in o.data]
    # The same figure on both ranks shows once, under both (as the same line or value would).
    assert len(pngs) == 1 and pngs[0].metadata["monarch_kernel"] == {"ranks": [0, 1]}, text(out)
    assert "[ranks 0-1]\n" in text(out), text(out)
    (tmp_path / "mk_reloaded.py").write_text("def answer():\n    return 1\n")
    cell(mesh_kc, f"%%mesh\nimport sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
                  "%load_ext autoreload\n%autoreload 2\nimport mk_reloaded")
    out = cell(mesh_kc, "%%mesh\nmk_reloaded.answer()")
    assert "[ranks 0-3] 1" in out, out
    (tmp_path / "mk_reloaded.py").write_text("def answer():\n    return 2  # edited\n")
    os.utime(tmp_path / "mk_reloaded.py", (1e9 + 10, 2e9))  # a newer mtime, however fast we are
    out = cell(mesh_kc, "%%mesh\nmk_reloaded.answer()")
    assert "[ranks 0-3] 2" in out, out


@pytest.mark.timeout(150)
def test_pip_runs_once_per_host(mesh_kc):
    out = cell(mesh_kc, "%%mesh\n%pip --version\n_exit_code", timeout=120)
    runs = re.findall(r"^(\[ranks? [\d,-]+\]) pip \d+\S* from ", out, re.M)
    assert runs == ["[rank 0]"], out  # once for the host, by its lowest rank: not [ranks 0-3]
    assert "[rank 0] %pip runs once per host" in out and "ranks 0-3)" in out, out
    assert "[ranks 0-3] 0" in out, out  # every rank has the exit code of the one run
    out = cell(mesh_kc, "%%mesh --ranks 2-3\n%pip --version", timeout=120)
    assert re.findall(r"^(\[ranks? [\d,-]+\]) pip \d+\S* from ", out, re.M) == ["[rank 2]"], out
    out, reply = run(mesh_kc, "%%mesh\n%conda list")  # no conda here: it fails once, said on every rank
    shown = ANSI.sub("", text(out))
    assert reply["status"] == "error" and "does not appear to be a conda environment" in shown, shown
    # the other ranks' failures are one and the same: shown once, for ranks 1-3
    assert shown.count("[ranks 1-3] HostOnceError: %conda failed on rank 0, which ran it for this host") == 1, shown


@pytest.mark.timeout(120)
def test_debug_after_an_error_stops_in_the_mesh_pdb(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh --ranks 1\ndef f(v):\n    w = v * 2\n    return 1 / (w - w)\nf(3)")
    assert reply["status"] == "error", text(out)
    msg_id = mesh_kc.execute("%%mesh --ranks 1\n%debug", allow_stdin=True)
    answers, prompts = ["p w", "p v", "up", "c"], []

    def answer():
        try:
            req = mesh_kc.get_stdin_msg(timeout=0.05)
        except queue.Empty:
            return
        prompts.append(req["content"]["prompt"])
        assert answers, f"an unexpected prompt; output:\n{text(iopub(mesh_kc).outputs(msg_id))}"
        mesh_kc.input(answers.pop(0))

    shown = ANSI.sub("", text(iopub(mesh_kc).wait_idle(msg_id, 60, also=answer)))
    assert "rank 1 stopped after ZeroDivisionError: division by zero at cell line 4 (post-mortem)" in shown, shown
    assert "6\n3\n" in shown and "-> f(3)" in shown, shown
    assert prompts == ["(Pdb rank 1) "] * 4, prompts


def shell_reply(kc, msg_id: str, timeout: float = 30) -> dict:
    from support.kernels import reply_to

    return reply_to(kc, msg_id, timeout)


@pytest.mark.timeout(120)
def test_tab_and_shift_tab_in_a_mesh_cell_answer_from_the_ranks(mesh_kc):
    cell(mesh_kc, '%%mesh\ndef rank_only_helper(n):\n    "Triples n, on a rank."\n    return 3 * n\n'
                  "rank_only_value = 1")
    cell(mesh_kc, "%%mesh --ranks 2\nsolely_on_rank_two = 2")
    code = "%%mesh\nx = 1\nrank_only_v"
    reply = shell_reply(mesh_kc, mesh_kc.complete(code, len(code)))
    assert "rank_only_value" in reply["matches"], reply
    assert reply["metadata"]["monarch_kernel"]["answered_by"] == "rank 0", reply
    assert (reply["cursor_start"], reply["cursor_end"]) == (len(code) - len("rank_only_v"), len(code)), reply
    code = "%%mesh --ranks 2-3\nsolely_on_r"
    reply = shell_reply(mesh_kc, mesh_kc.complete(code, len(code)))
    assert reply["matches"] == ["solely_on_rank_two"], reply
    assert reply["metadata"]["monarch_kernel"]["answered_by"] == "rank 2", reply
    code = "%%mesh\nrank_only_helper("
    reply = shell_reply(mesh_kc, mesh_kc.inspect(code, len(code) - 1))
    assert reply["found"] and "Triples n, on a rank." in ANSI.sub("", reply["data"]["text/plain"]), reply
    # The kernel's own cells, and the %%mesh line itself, are the kernel's to complete.
    reply = shell_reply(mesh_kc, mesh_kc.complete("rank_only_v", len("rank_only_v")))
    assert reply["matches"] == [] and "monarch_kernel" not in reply["metadata"], reply
    reply = shell_reply(mesh_kc, mesh_kc.complete("pro", 3))
    assert "procs" in reply["matches"], reply
    # %mesh auto on: every cell is a mesh cell.
    cell(mesh_kc, "%mesh auto on")
    try:
        reply = shell_reply(mesh_kc, mesh_kc.complete("rank_only_v", len("rank_only_v")))
        assert reply["matches"] == ["rank_only_value"], reply
    finally:
        cell(mesh_kc, "%mesh auto off")


@pytest.mark.timeout(120)
def test_tab_falls_back_to_the_kernel_when_the_rank_cannot_answer(mesh_kc):
    import time

    from support.freeze import freeze, thaw

    out = cell(mesh_kc, "%%mesh --ranks 3\nimport os\nos.getpid()")
    pid = int(re.search(r"\[rank 3\] (\d+)", out).group(1))
    code = "%%mesh --ranks 3\npro"
    reply = shell_reply(mesh_kc, mesh_kc.complete(code, len(code)))  # the completer is up before we freeze
    assert reply["metadata"]["monarch_kernel"]["answered_by"] == "rank 3", reply
    freeze(pid)
    try:
        t0 = time.monotonic()
        reply = shell_reply(mesh_kc, mesh_kc.complete(code, len(code)))
        took = time.monotonic() - t0
    finally:
        thaw(pid)
    said = reply["metadata"]["monarch_kernel"]
    assert said["answered_by"] == "controller" and "rank 3 did not answer within 200 ms" in said["why"], reply
    assert "procs" in reply["matches"], reply  # the kernel's own namespace
    assert took < 2.0, f"a frozen rank held Tab for {took:.2f} s"


@pytest.mark.timeout(120)
def test_the_stop_button_ends_a_shell_command_and_what_it_started(mesh_kc):
    import time

    import psutil
    from support.kernels import reply_to

    out = cell(mesh_kc, "%%mesh --ranks 0-1\nimport os\nos.getpid()")
    pids = [int(p) for p in re.findall(r"\[rank \d\] (\d+)", out)]
    msg_id = mesh_kc.execute("%%mesh --ranks 0-1\n!echo started; sleep 60; echo slept")

    def sleepers() -> list:
        return [c for p in pids for c in psutil.Process(p).children(recursive=True) if c.name() == "sleep"]

    iopub(mesh_kc).wait("both ranks' sleep to start", lambda: len(sleepers()) == 2, 30,
                        detail=iopub(mesh_kc).so_far(msg_id))
    started = sleepers()
    t0 = time.monotonic()
    mesh_kc.parent.interrupt_kernel()
    reply = reply_to(mesh_kc, msg_id, 30)
    assert reply["ename"] == "KeyboardInterrupt", reply
    assert time.monotonic() - t0 < 5, "the interrupt did not end the shell command at once"
    gone, alive = psutil.wait_procs(started, timeout=5)
    assert not alive, f"the shell command's sleep outlived the interrupt: {alive}"
    assert "slept" not in text(iopub(mesh_kc).outputs(msg_id))
    out = cell(mesh_kc, "%%mesh --ranks 0-1\n!echo still a shell here")  # the namespace and the shell go on
    assert said_by(out, "still a shell here") == [0, 1], out


@pytest.mark.timeout(120)
def test_magics_without_their_percent_and_a_misspelt_magic(mesh_kc, tmp_path):
    cell(mesh_kc, "%%mesh\nimport os\nstart_dir = os.getcwd()")
    try:
        out = cell(mesh_kc, f"%%mesh\ncd {tmp_path}")  # parses as Python (cd / tmp_path), read as IPython reads it
        assert said_by(out, str(tmp_path)) == [0, 1, 2, 3], out  # cd prints the folder
        out = cell(mesh_kc, "%%mesh\npwd")
        assert f"[ranks 0-3] {str(tmp_path)!r}" in out, out
    finally:
        cell(mesh_kc, "%%mesh\ncd $start_dir")
    out, reply = run(mesh_kc, "%%mesh --ranks 0\n%frobnicate now")
    shown = ANSI.sub("", text(out))
    assert reply["status"] == "error" and "UsageError: Line magic function `%frobnicate` not found." in shown, shown
    assert "interactiveshell.py" not in shown and "%frobnicate now" in shown, shown  # the cell line, no IPython frames
