"""Rank output through a real kernel, counted at the client: a flood arrives whole and in
order in few iopub messages, collapsing merges only ranks' matching lines, and a very long
line neither blocks the rank's print nor arrives as one message."""

from __future__ import annotations

import re

import pytest
from support.kernels import run, text

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def mesh_kc(module_kc):
    """The module's kernel, with a mesh of two ranks."""
    out, reply = run(module_kc, "procs = %mesh spawn -n 2")
    assert reply["status"] == "ok", text(out)
    return module_kc


def rank_lines(out, label: str) -> list[str]:
    prefix = label + " "
    return [line[len(prefix):] for line in text(out).splitlines() if line.startswith(prefix)]


def test_a_flood_of_lines_all_arrive_in_order_in_few_messages(mesh_kc):
    n = 30_000
    out, reply = run(mesh_kc, f"%%mesh --ranks 0\nfor i in range({n}):\n    print(i)", timeout=120)
    assert reply["status"] == "ok", text(out)[-2000:]
    got = rank_lines(out, "[rank 0]")
    missing = n - len(set(got))
    assert got == [str(i) for i in range(n)], f"{missing} of {n} lines lost or out of order"
    assert len(out) < n / 100, f"{len(out)} iopub messages for {n} lines: not batched"


def test_only_matching_lines_of_different_ranks_collapse(mesh_kc):
    out, reply = run(mesh_kc, "%%mesh\nimport time\nfrom monarch_kernel import current_rank\n"
                         "print('hello', flush=True)\n"
                         "for _ in range(3):\n    print('epoch done', flush=True)\n    time.sleep(0.05)\n"
                         "if current_rank().rank == 1:\n"
                         "    for _ in range(5):\n        print('rank one again', flush=True)")
    assert reply["status"] == "ok", text(out)
    t = text(out)
    assert t.count("[ranks 0-1] hello\n") == 1
    assert t.count("[ranks 0-1] epoch done\n") == 3, t
    assert t.count("[rank 1] rank one again\n") == 5, t
    assert "[rank 0] epoch done" not in t and "[rank 1] epoch done" not in t


def test_a_very_long_line_arrives_whole_in_pieces_without_blocking_print(mesh_kc):
    n = 10_000_000
    out, reply = run(mesh_kc, "%%mesh --ranks 0\nimport time\nt = time.perf_counter()\n"
                         f"print('x' * {n}, flush=True)\nround(time.perf_counter() - t, 3)", timeout=120)
    assert reply["status"] == "ok", text(out)[-2000:]
    pieces = rank_lines(out, "[rank 0]")
    blocked = float(re.fullmatch(r"[0-9.]+", pieces[-1]).group())
    xs = [p for p in pieces if p.startswith("x")]
    assert "".join(xs) == "x" * n
    assert len(xs) >= 5 and max(map(len, xs)) <= 2 << 20, "the line was held and sent whole"
    assert blocked < 0.5, f"print of a 10 MB line blocked the rank for {blocked} s"


def test_a_ranks_log_records_show_as_a_plain_kernels_would(mesh_kc):
    """WARNING and up, the message alone (Python's last resort), with no prefix of ours: a
    library's INFO records (matplotlib's font manager) stay out of the cell, and out of the
    rank's last line, which is the last line it printed."""
    out, reply = run(mesh_kc, "%%mesh\nimport logging, time\nlog = logging.getLogger('some.library')\n"
                              "log.warning('disk almost full')\ntime.sleep(0.3)\nprint('working', flush=True)\n"
                              "log.info('font cache built')\nlogging.info('root info')\ntime.sleep(0.3)")
    assert reply["status"] == "ok", text(out)
    t = text(out)
    warned = [o for o in out if "disk almost full" in o.text]
    assert "[ranks 0-1] disk almost full\n" in t and all(o.name == "stderr" for o in warned), t
    assert "font cache built" not in t and "root info" not in t, t
    assert "actor=" not in t and "WARNING" not in t, t
    out, reply = run(mesh_kc, "%mesh status")
    rows = [line for line in text(out).splitlines() if line.startswith("  rank ")]
    assert len(rows) == 2 and all(row.endswith("| working") for row in rows), text(out)


def test_what_ranks_print_before_answering_a_plain_cells_calls_shows_in_that_cell(mesh_kc):
    """An actor's answer travels apart from its output and overtakes it: the cell waits for
    the output its calls' ranks wrote before answering, so none of it shows in the next cell
    (nor is lost, as a client that stopped reading the ended cell would lose it)."""
    out, reply = run(mesh_kc, "from monarch_kernel import Actor, endpoint\n"
                              "class Talker(Actor):\n"
                              "    @endpoint\n"
                              "    def talk(self, n, tag):\n"
                              "        for i in range(n):\n"
                              "            print(f'{tag} line {i}')\n"
                              "        print(f'{tag} last words', flush=True)\n"
                              "        return n\n"
                              "talkers = procs.spawn('talkers', Talker)")
    assert reply["status"] == "ok", text(out)
    for tag in ("a", "b", "c"):
        out, reply = run(mesh_kc, f"talkers.talk.call(3000, {tag!r}).get(timeout=60); None", timeout=120)
        assert reply["status"] == "ok", text(out)[-2000:]
        got = rank_lines(out, "[ranks 0-1]")
        assert got[-1:] == [f"{tag} last words"] and len(got) == 3001, (tag, len(got), got[-3:], text(out)[-500:])
    out, reply = run(mesh_kc, "1 + 1")
    assert "line" not in text(out) and "last words" not in text(out), text(out)[:500]


def test_a_mesh_cell_ends_without_a_drain_unless_it_sent_something_else(mesh_kc):
    """A ``%%mesh`` cell's ranks send their end markers after their output, so the cell has
    it all once they are in: its end skips the drain (a round trip to every template and
    agent on each cell).  A cell that sent a call as well still drains: that call's output
    may trail its answer.  The drains are counted by a wrapper around the kernel's runtime."""
    spy = ("from monarch_kernel import Actor, endpoint\n"
           "from monarch_kernel.runtime import Runtime\n"
           "_rt = Runtime.current(); _drains = []; _real_drain = _rt.drain_output\n"
           "def _counting(timeout):\n    _drains.append(timeout)\n    return _real_drain(timeout)\n"
           "_rt.drain_output = _counting\n"
           "class Echo(Actor):\n    @endpoint\n    def echo(self, x):\n        return x\n"
           "echoes = procs.spawn('echoes', Echo)")
    out, reply = run(mesh_kc, spy)
    assert reply["status"] == "ok", text(out)
    try:
        def drains_at_the_end_of(cell: str) -> int:
            run(mesh_kc, "_n = len(_drains)")  # this cell's own end drains once
            out, reply = run(mesh_kc, cell)
            assert reply["status"] == "ok", text(out)
            out, _ = run(mesh_kc, "print(len(_drains) - _n - 1)")
            return int(text(out).strip())

        assert drains_at_the_end_of("%%mesh\nprint('from the ranks')") == 0
        assert drains_at_the_end_of("get_ipython().run_cell_magic('mesh', '', 'print(1)')") == 0
        assert drains_at_the_end_of("echoes.echo.call(1).get(timeout=30)") == 1
        assert drains_at_the_end_of("echoes.echo.call(1).get(timeout=30)\n"
                                    "get_ipython().run_cell_magic('mesh', '', 'print(1)')") == 1
        assert drains_at_the_end_of("get_ipython().run_cell_magic('mesh', '', 'print(1)')\n"
                                    "echoes.echo.broadcast(1)") == 1
    finally:
        run(mesh_kc, "del _rt.drain_output")
