"""A rank's output as a stream of bytes, through a real kernel: a line not yet ended shows at
once and is completed in place, the cell-end marker never shows nor stalls the cell whatever
the user writes, ``\\r`` and ANSI codes redraw the rank's own labelled line (tqdm, pip), the
progress line stays last and goes, and ``input()`` on a rank fails at once, saying why."""

from __future__ import annotations

import re
import time

import nbformat
import pytest
from nbclient import NotebookClient
from support.kernels import ANSI, iopub, reply_to, run, text

pytestmark = pytest.mark.timeout(180)

MARKER = "monarch-sync"
PROGRESS = re.compile(r"\[mesh\] \d+ of \d+ ranks? finished")
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


@pytest.fixture(scope="module")
def mesh_kc(module_kc):
    """The module's kernel, with a mesh of two ranks."""
    out, reply = run(module_kc, "procs = %mesh spawn -n 2", timeout=120)
    assert reply["status"] == "ok", text(out)
    return module_kc


def shown_lines(out) -> list[str]:
    """The cell's lines as a reader sees them (a line's trailing blanks are not seen)."""
    return [line.rstrip(" ") for line in text(out).split("\n")[:-1]]


def timed(kc, code: str, timeout: float = 60):
    start = time.monotonic()
    out, reply = run(kc, code, timeout)
    return out, reply, time.monotonic() - start


def test_a_partial_line_shows_at_once_and_is_completed_in_place(mesh_kc):
    msg_id = mesh_kc.execute("%%mesh --ranks 0\nimport time\nprint('x', end='', flush=True)\ntime.sleep(2.5)\n"
                             "print('yz')")
    collector = iopub(mesh_kc)
    seen = collector.wait("the partial line [rank 0] x", lambda: "[rank 0] x" in text(collector.outputs(msg_id)),
                          timeout=30)
    del seen
    first = time.monotonic()
    out = collector.wait_idle(msg_id, timeout=60)
    assert reply_to(mesh_kc, msg_id)["status"] == "ok", text(out)
    assert time.monotonic() - first > 1.0, "the partial line showed only when its line ended"
    assert shown_lines(out) == ["[rank 0] xyz"], repr(text(out))


@pytest.mark.parametrize("code, shown", [
    ("print('x', end='')", ["[ranks 0-1] x"]),
    ("import sys\nsys.stdout.write('abc'); sys.stdout.flush()", ["[ranks 0-1] abc"]),
    ("import sys\n_ = sys.stdout.write('almost\\r')", ["[ranks 0-1] almost"]),
    ("print('\\x1emonarch-sync ' + 'f' * 32)\nprint('\\x1emonarch-sync ' + 'f' * 32, end='')",
     ["[ranks 0-1] \x1emonarch-sync " + "f" * 32] * 2),
    ("import os\n_ = os.write(1, b'bin\\x00\\xff\\x1e')", ["[ranks 0-1] bin\x00\ufffd\x1e"]),
])
def test_output_that_does_not_end_a_line_never_shows_the_marker_nor_stalls(mesh_kc, code, shown):
    out, reply, took = timed(mesh_kc, "%%mesh\n" + code)
    assert reply["status"] == "ok", text(out)
    lines = shown_lines(out)
    assert lines == shown, lines
    assert took < 3, f"the cell took {took:.1f} s: it waited for its marker"


@pytest.mark.parametrize("after", [0, 2.5], ids=["at-once", "past-the-progress-line"])
def test_the_marker_is_found_after_a_partial_line_on_stderr_too(mesh_kc, after):
    """A cell that runs past 2 s (on purpose, or on a loaded machine) shows its open line as
    the cell's last line, then ends it in place: more outputs, the same text, all on stderr."""
    code = f"%%mesh\nimport sys, time\n_ = sys.stderr.write('no newline'); sys.stderr.flush(); time.sleep({after})"
    out, reply, took = timed(mesh_kc, code)
    assert reply["status"] == "ok", text(out)
    assert {o.name for o in out if o.kind == "stream" and o.text.strip()} == {"stderr"}, out
    assert shown_lines(out) == ["[ranks 0-1] no newline"] and MARKER not in text(out)
    assert took < after + 3, f"the cell took {took:.1f} s"


def test_a_carriage_return_rewrites_the_ranks_own_labelled_line(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\nimport sys, time\n_ = sys.stdout.write('progress 50%\\r'); sys.stdout.flush()\n"
                              "time.sleep(0.5)\n_ = sys.stdout.write('progress 100%\\n')")
    assert reply["status"] == "ok", text(out)
    assert shown_lines(out) == ["[ranks 0-1] progress 100%"], repr(text(out))
    out, _ = run(mesh_kc, "%mesh status")
    rows = [line for line in text(out).splitlines() if line.startswith("  rank ")]
    assert len(rows) == 2 and all(row.endswith("| progress 100%") for row in rows), text(out)


def test_tqdm_bars_keep_their_rank(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\nimport time\nfrom tqdm import tqdm\nfrom monarch_kernel import current_rank\n"
                              "for _ in tqdm(range(20), desc=f'r{current_rank().rank}', mininterval=0, ascii=True):\n"
                              "    time.sleep(0.03)")
    assert reply["status"] == "ok", text(out)
    lines = [line for line in shown_lines(out) if line.strip()]
    assert len(lines) == 2, lines
    for r in (0, 1):
        [line] = [line for line in lines if f"r{r}:" in line]
        assert line.startswith(f"[rank {r}] r{r}: 100%|##########| 20/20 "), line


def test_pip_style_progress_shows_cleanly(mesh_kc):
    """The codes pip's progress bar (rich) writes: the bar redrawn after erasing its line,
    colours, the cursor hidden and shown again."""
    bar = ("\x1b[?25l\r\x1b[2K   \x1b[90m----\x1b[0m \x1b[32m1.0/2.0 MB\x1b[0m \x1b[31meta 0:00:01\x1b[0m"
           "\r\x1b[2K   \x1b[32m----\x1b[0m \x1b[32m2.0/2.0 MB\x1b[0m \x1b[36m0:00:00\x1b[0m\n\x1b[?25h")
    out, reply = run(mesh_kc, f"%%mesh\nimport sys, time\nfor part in {bar!r}.split('\\r'):\n"
                              "    _ = sys.stdout.write(part + '\\r' if not part.endswith('h') else part)\n"
                              "    sys.stdout.flush()\n    time.sleep(0.2)")
    assert reply["status"] == "ok", text(out)
    shown = text(out)
    plain = ESCAPES.sub("", shown)
    assert "\x1b" not in plain and "[0m" not in plain, repr(shown)
    assert [line.rstrip() for line in plain.split("\n") if line.strip()] == ["[ranks 0-1]    ---- 2.0/2.0 MB 0:00:00"]


def test_the_progress_line_stays_last_and_goes_when_the_cell_ends(mesh_kc):
    msg_id = mesh_kc.execute("%%mesh --ranks 0\nimport time\nprint('before', flush=True)\ntime.sleep(3.5)\n"
                             "print('after', flush=True)\ntime.sleep(1)")
    collector = iopub(mesh_kc)
    collector.wait("the progress line", lambda: PROGRESS.search(text(collector.outputs(msg_id))), timeout=30)
    collector.wait("the line after the progress line",
                   lambda: "after" in text(collector.outputs(msg_id)), timeout=30)
    while_running = text(collector.outputs(msg_id))
    out = collector.wait_idle(msg_id, timeout=60)
    assert not PROGRESS.search(while_running.split("after", 1)[0]), \
        f"the progress line stayed between the lines: {while_running!r}"
    assert shown_lines(out) == ["[rank 0] before", "[rank 0] after"], repr(text(out))
    assert not any(o.kind == "display_data" for o in out), out


def test_a_saved_notebook_keeps_no_empty_output(kernelspec, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "procs = %mesh spawn -n 2",
        "%%mesh\nimport time\ntime.sleep(3)",
        "%%mesh\nimport time\nprint('one', flush=True)\ntime.sleep(3)\nprint('two')",
        "%%mesh\nimport sys, time\nsys.stdout.write('half'); sys.stdout.flush(); time.sleep(3)",
        "procs.stop().get()",
    )]
    client = NotebookClient(nb, kernel_name=kernelspec, timeout=120, coalesce_streams=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    for cell in nb.cells:
        for output in cell.outputs:
            if output.output_type == "stream":
                assert output.text.strip(), f"an empty {output.name} output in {cell.source!r}"
            elif output.output_type in ("display_data", "execute_result"):
                assert output.data and any(str(v).strip() for v in output.data.values()), cell.source
    silent, printing, half = (re.sub(" +\n", "\n", ANSI.sub("", "".join(o.get("text", "") for o in c.outputs)))
                              for c in nb.cells[1:4])
    assert re.fullmatch(r"\[mesh\] 2 of 2 ranks finished \(\d s\)\n", silent), repr(silent)
    assert printing == "[ranks 0-1] one\n[ranks 0-1] two\n", repr(printing)
    assert half == "[ranks 0-1] half\n", repr(half)


def test_input_on_a_rank_fails_at_once_saying_why(mesh_kc):
    out, reply, took = timed(mesh_kc, "%%mesh\nname = input('your name? ')")
    assert reply["status"] == "error"
    assert "input() on a rank" in text(out) and "%mesh push" in text(out), text(out)
    assert MARKER not in text(out)
    assert took < 3, f"input() took {took:.1f} s to fail"
