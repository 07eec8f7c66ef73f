"""Rank output without a kernel: the collapsing rules on their own, the notebook sink's
threads writing into a cell's context, and the controller's line reader on long lines."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time

import pytest
from support.config import configured

from monarch_kernel.kernel.collapse import HOLD_S, Collapser
from monarch_kernel.kernel.output import CollapsingSink
from monarch_kernel.runtime.spawn.rank_output import LineReader
from monarch_kernel.runtime.template.server import READ_SIZE

pytestmark = pytest.mark.timeout(60)


def shown(entries) -> list[str]:
    return [e.text().rstrip("\n") for e in entries]


def test_the_same_line_from_every_rank_collapses():
    c = Collapser()
    for r in range(4):
        c.add("m", r, "stdout", "hello", now=0.0)
    assert shown(c.take_all()) == ["[ranks 0-3] hello"]


def test_a_ranks_own_repeated_line_shows_every_time():
    c = Collapser()
    for _ in range(5):
        c.add("m", 0, "stdout", "again", now=0.0)
    assert shown(c.take_all()) == ["[rank 0] again"] * 5


def test_two_ranks_repeating_a_line_show_it_once_per_repeat():
    c = Collapser()
    for k in range(3):
        for r in (0, 1):
            c.add("m", r, "stdout", "epoch done", now=0.05 * k)
    assert shown(c.take_all()) == ["[ranks 0-1] epoch done"] * 3


def test_one_rank_running_ahead_still_lines_up_with_the_other():
    c = Collapser()
    for _ in range(3):
        c.add("m", 0, "stdout", "step", now=0.0)
    c.add("m", 1, "stdout", "step", now=0.01)
    assert shown(c.take_all()) == ["[ranks 0-1] step", "[rank 0] step", "[rank 0] step"]


def test_collapsing_never_reorders_a_ranks_lines():
    c = Collapser()
    c.add("m", 0, "stdout", "A", now=0.0)
    c.add("m", 0, "stdout", "B", now=0.0)
    c.add("m", 1, "stdout", "B", now=0.0)
    c.add("m", 1, "stdout", "A", now=0.0)  # must not join rank 0's A, which came before B
    assert shown(c.take_all()) == ["[rank 0] A", "[ranks 0-1] B", "[rank 1] A"]


def test_streams_and_meshes_do_not_merge():
    c = Collapser()
    c.add("m", 0, "stdout", "x", now=0.0)
    c.add("m", 1, "stderr", "x", now=0.0)
    c.add("n", 2, "stdout", "x", now=0.0)
    assert [(e.mesh, e.stream, sorted(e.ranks)) for e in c.take_all()] == [
        ("m", "stdout", [0]), ("m", "stderr", [1]), ("n", "stdout", [2])]


def test_a_line_waits_for_its_window_then_no_longer_merges():
    c = Collapser(window=0.15)
    c.add("m", 0, "stdout", "late", now=0.0)
    assert c.take_due(0.1) == []
    assert shown(c.take_due(0.2)) == ["[rank 0] late"]
    c.add("m", 1, "stdout", "late", now=0.3)
    assert shown(c.take_all()) == ["[rank 1] late"]


def test_a_flood_of_one_repeated_line_stays_fast():
    c = Collapser()
    start = time.monotonic()
    for i in range(100_000):
        c.add("m", 0, "stdout", "same", now=i * 1e-6)
        c.add("m", 1, "stdout", "same", now=i * 1e-6)
    entries = c.take_all()
    assert len(entries) == 100_000 and all(e.ranks == {0, 1} for e in entries)
    assert time.monotonic() - start < 5, "collapsing is not linear in the number of lines"


class CellStream:
    """A slow stdout that records, like ipykernel's, which cell (context variable) each
    write belongs to."""

    def __init__(self, var, delay: float = 0.001):
        self.var, self.delay, self.writes, self.lock = var, delay, [], threading.Lock()

    def write(self, s: str) -> int:
        time.sleep(self.delay)
        with self.lock:
            self.writes.append((self.var.get(None), s))
        return len(s)

    def flush(self) -> None:
        pass


def written(out: CellStream) -> int:
    with out.lock:
        return sum(s.count("\n") for _c, s in out.writes)


@pytest.fixture
def io_loop():
    """An asyncio loop on its own thread, standing in for the runtime's IO thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_lines_written_while_the_cell_flushes_all_arrive_in_their_cell(io_loop, monkeypatch):
    cell = contextvars.ContextVar("cell")
    out = CellStream(cell)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(io_loop)
    cell.set("cell-1")
    sink.follow_cell()
    n, per, errors = 5000, 100, []

    def feed(start):  # on the IO thread, as the pipe readers call it
        for i in range(start, min(start + per, n)):
            sink("m", 0, "stdout", str(i))

    for k, start in enumerate(range(0, n, per)):
        io_loop.call_soon_threadsafe(feed, start)
        time.sleep(0.01)
        if k % 20 == 19:  # now and then, as a cell ends or pdb stops, the main thread flushes
            try:
                sink.flush()
            except RuntimeError as e:
                errors.append(e)
    done = threading.Event()
    io_loop.call_soon_threadsafe(done.set)
    assert done.wait(30), "timed out after 30 s waiting for the IO thread to feed every line"
    deadline = time.monotonic() + 10  # the writer thread prints what its windows let go
    while written(out) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    sink.flush()
    if hasattr(sink, "close"):
        sink.close()
    assert not errors, errors[0]
    lines = "".join(s for _c, s in out.writes).splitlines()
    assert len(lines) == n and lines == [f"[rank 0] {i}" for i in range(n)], f"{n - len(lines)} of {n} lines lost"
    assert {c for c, _s in out.writes} == {"cell-1"}
    assert len(out.writes) < n / 20, f"{len(out.writes)} writes for {n} lines: not batched"


def test_the_context_handed_out_is_a_new_copy_each_time():
    sink = CollapsingSink(None)
    sink.follow_cell()
    a, b = sink.context, sink.context
    assert a is not b
    a.run(lambda: b.run(lambda: None))  # two copies can be entered at once
    sink.close()


def test_held_lines_flush_by_rank_and_sync_markers_count(monkeypatch):
    from monarch_kernel.console.console import SYNC

    out = CellStream(contextvars.ContextVar("cell"), delay=0)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(None, window=0.01)
    sink.hold = True
    for r in (1, 0):
        sink("m", r, "stdout", f"first {r}")
        sink("m", r, "stdout", f"second {r}")
    time.sleep(0.1)
    assert out.writes == [], "--no-stream printed before the cell ended"
    tok = "0" * 32
    sink.expect(tok)
    for r in (0, 1):
        sink("m", r, "stdout", SYNC + tok)
    assert sink.finished(tok) == 2
    assert sink.wait_synced(tok, {("m", 0, "stdout"), ("m", 1, "stdout")}, 5, by_rank=True)
    assert "".join(s for _c, s in out.writes).splitlines() == [
        "[rank 0] first 0", "[rank 0] second 0", "[rank 1] first 1", "[rank 1] second 1"]
    assert sink.last_lines == {("m", 0): "second 0", ("m", 1): "second 1"}
    sink.close()


class Reader:
    """A pipe read on the IO loop in chunks, as the template reads a rank's, each fed to the
    controller's ``LineReader``; with what its sink received."""

    def __init__(self, loop):
        self.loop = loop
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.got: list[str] = []
        self.eof = threading.Event()
        self.lines = LineReader("m", 0, "stdout", lambda: self.sink)
        ready = threading.Event()

        def start():
            loop.add_reader(self.r, self._readable)
            ready.set()

        loop.call_soon_threadsafe(start)
        assert ready.wait(5), "timed out after 5 s waiting for the reader to start"

    def _readable(self):
        try:
            data = os.read(self.r, READ_SIZE)
        except BlockingIOError:
            return
        if data:
            self.lines.feed(data)
            return
        self.loop.remove_reader(self.r)
        os.close(self.r)
        self.lines.close()
        self.eof.set()

    def sink(self, mesh, rank, stream, line):
        self.got.append(line)

    def write_and_close(self, data: bytes) -> float:
        """Seconds the write took (how long a rank's print blocks)."""
        start = time.monotonic()
        view = memoryview(data)
        while view:
            view = view[os.write(self.w, view):]
        took = time.monotonic() - start
        os.close(self.w)
        assert self.eof.wait(30), "timed out after 30 s waiting for the reader to reach EOF"
        return took


def test_a_long_line_is_read_in_linear_time_and_cut_into_bounded_pieces(io_loop):
    reader = Reader(io_loop)
    n = 32 << 20
    start = time.monotonic()
    blocked = reader.write_and_close(b"x" * n + b"\nnext\n")
    took = time.monotonic() - start
    assert "".join(reader.got[:-1]) == "x" * n and reader.got[-1] == "next"
    assert max(len(piece) for piece in reader.got) <= 2 << 20, "a long line was held whole"
    assert took < 4, f"a 32 MiB line took {took:.1f} s to read"
    assert blocked < 4, f"writing a 32 MiB line blocked for {blocked:.1f} s"


def test_pieces_of_a_long_line_never_split_a_character(io_loop):
    with configured(max_line=1024):
        reader = Reader(io_loop)  # its LineReader reads max_line when it is made
    text = "é€" * 5000
    reader.write_and_close(text.encode() + b"\r\nshort\r\ntail without newline")
    assert "".join(reader.got[:-2]) == text
    assert len(reader.got) > 20 and all(len(p.encode()) <= 1024 for p in reader.got[:-2])
    assert reader.got[-2:] == ["short", "tail without newline"]


# ---------------------------------------------------------------- more of the pure rules


def test_entries_come_due_in_arrival_order_at_their_deadlines():
    c = Collapser(window=1.0)
    assert not c and c.next_deadline() is None
    c.add("m", 0, "stdout", "a", now=0.0)
    c.add("m", 0, "stdout", "b", now=0.5)
    c.add("m", 1, "stdout", "a", now=0.75)  # joins rank 0's "a": it waits a window more for others
    assert c and c.next_deadline() == 1.75
    assert c.take_due(1.5) == []  # "b" is due at 1.5, but never shows before the "a" above it
    assert shown(c.take_due(1.75)) == ["[ranks 0-1] a", "[rank 0] b"]
    assert not c and c.take_all() == []
    # Joins hold a line open at most HOLD_S (here the window, 1 s, is longer) after it came.
    c.add("m", 0, "stdout", "x", now=10.0)
    for r, t in ((1, 10.5), (2, 10.9), (3, 11.4)):
        c.add("m", r, "stdout", "x", now=t)
    assert c.next_deadline() == 10.0 + max(1.0, HOLD_S)
    assert shown(c.take_all()) == ["[ranks 0-3] x"]


def test_ranks_that_are_not_neighbours_collapse_under_one_label():
    c = Collapser()
    for r in (4, 0, 2):
        c.add("m", r, "stderr", "warning: slow", now=0.0)
    c.add("m", 1, "stderr", "other", now=0.0)
    entries = c.take_all()
    assert shown(entries) == ["[ranks 0,2,4] warning: slow", "[rank 1] other"]
    assert entries[0].text() == "[ranks 0,2,4] warning: slow\n"


def test_a_ranks_copy_after_the_entry_was_shown_starts_a_new_one():
    c = Collapser()
    c.add("m", 0, "stdout", "x", now=0.0)
    assert shown(c.take_all()) == ["[rank 0] x"]
    c.add("m", 1, "stdout", "x", now=0.0)
    c.add("m", 0, "stdout", "x", now=0.0)
    assert shown(c.take_all()) == ["[ranks 0-1] x"]


class Recorder:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        self.writes.append("<flush>")


def test_entries_are_written_one_write_per_run_of_a_stream(monkeypatch):
    from monarch_kernel.kernel.collapse import Entry
    from monarch_kernel.kernel.output import write_entries

    out, err = Recorder(), Recorder()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    entries = [Entry("m", s, line, r, 0.0, i) for i, (s, line, r) in enumerate(
        [("stdout", "a", 0), ("stdout", "b", 1), ("stderr", "oops", 1), ("stdout", "c", 0)])]
    write_entries(entries)
    assert out.writes == ["[rank 0] a\n[rank 1] b\n", "<flush>", "[rank 0] c\n", "<flush>"]
    assert err.writes == ["[rank 1] oops\n", "<flush>"]


def test_a_big_run_is_cut_into_writes_of_about_write_chars(monkeypatch):
    from monarch_kernel.kernel import output

    out = Recorder()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr(output, "WRITE_CHARS", 100)
    entries = [output.Entry("m", "stdout", "x" * 40, 0, 0.0, i) for i in range(7)]
    output.write_entries(entries)
    writes = [w for w in out.writes if w != "<flush>"]
    assert "".join(writes) == "".join(e.text() for e in entries)
    assert [w.count("\n") for w in writes] == [2, 2, 2, 1]  # 50 chars each: a write ends at 100


def test_a_closed_stream_does_not_fail_the_writer(monkeypatch):
    from monarch_kernel.kernel.collapse import Entry
    from monarch_kernel.kernel.output import write_entries

    class Closed:
        def write(self, s):
            raise ValueError("I/O operation on closed file")

    monkeypatch.setattr("sys.stdout", Closed())
    write_entries([Entry("m", "stdout", "late", 0, 0.0, 0)])


def test_the_writer_prints_a_line_once_its_window_closes_in_the_cells_context(monkeypatch):
    cell = contextvars.ContextVar("cell")
    out = CellStream(cell, delay=0)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(None, window=0.05)
    assert sink.context is None  # no cell yet
    cell.set("cell-7")
    sink.follow_cell()
    cell.set("elsewhere")  # the writer uses the context the cell started with
    try:
        sink("m", 0, "stdout", "hi")
        sink("m", 1, "stdout", "hi")
        assert sink.last_lines == {("m", 0): "hi", ("m", 1): "hi"}
        deadline = time.monotonic() + 10
        while written(out) < 1:
            assert time.monotonic() < deadline, "timed out after 10 s waiting for the writer to print the line"
            time.sleep(0.01)
        assert out.writes == [("cell-7", "[ranks 0-1] hi\n")]
    finally:
        sink.close()


def test_close_prints_what_is_pending_and_ends_the_writer(monkeypatch):
    out = CellStream(contextvars.ContextVar("cell"), delay=0)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(None, window=60)  # nothing would come due during the test
    sink("m", 0, "stdout", "pending")
    writer = sink._writer
    sink.close()
    assert [s for _c, s in out.writes] == ["[rank 0] pending\n"]
    assert writer is not None and not writer.is_alive()
    sink("m", 0, "stdout", "after close")  # recorded, but no writer starts again
    assert sink._writer is writer


def test_sync_markers_count_stdout_only_and_a_missing_one_times_out(monkeypatch):
    from monarch_kernel.console.console import SYNC

    out = CellStream(contextvars.ContextVar("cell"), delay=0)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(None, window=60)
    t1 = "1" * 32
    try:
        sink.expect(t1)
        sink("m", 0, "stdout", "line")
        sink("m", 0, "stdout", SYNC + t1)
        sink("m", 0, "stderr", SYNC + t1)
        sink("m", 1, "stderr", SYNC + t1)
        assert sink.finished(t1) == 1 and sink.finished("other") == 0
        assert sink.last_lines == {("m", 0): "line"}, "markers are not lines"
        expected = {("m", 0, "stdout"), ("m", 1, "stdout")}
        start = time.monotonic()
        assert not sink.wait_synced(t1, expected, 0.2)
        assert time.monotonic() - start >= 0.2
        # It flushed anyway, and forgot the token.
        assert [s for _c, s in out.writes] == ["[rank 0] line\n"] and sink.finished(t1) == 0
    finally:
        sink.close()


def test_a_stream_still_writing_keeps_the_cell_open_past_its_quiet_time(monkeypatch):
    """The cell waits for output that is still arriving (a 10 MB line through a loaded host
    comes seconds after the rank's call returned): it gives up only on a stream silent for
    ``quiet``, so nothing the cell printed lands after it."""
    from monarch_kernel.console.console import SYNC

    out = CellStream(contextvars.ContextVar("cell"), delay=0)
    monkeypatch.setattr("sys.stdout", out)
    sink = CollapsingSink(None, window=0.01)
    tok = "2" * 32
    done = threading.Event()

    def rank() -> None:
        for i in range(8):  # 0.8 s of output, four times the quiet time
            sink.write("m", 0, "stdout", f"piece {i}\n")
            time.sleep(0.1)
        sink.write("m", 0, "stdout", SYNC + tok + "\n")
        done.set()

    try:
        sink.expect(tok)
        writer = threading.Thread(target=rank)
        writer.start()
        assert sink.wait_synced(tok, {("m", 0, "stdout")}, 0.2)
        assert done.is_set()
        shown = "".join(s for _c, s in out.writes)
        assert shown == "".join(f"[rank 0] piece {i}\n" for i in range(8)), shown
        writer.join(timeout=10)
    finally:
        sink.close()


def test_a_ranks_last_line_skips_warnings_and_profiler_chatter():
    """What %mesh status and the panel show as a rank's last line: the last line that says
    something; a warning (and the source line under it) or kineto's chatter only while the
    rank printed nothing else."""
    from monarch_kernel.kernel.last_lines import LastLines

    last = LastLines()
    last.note("m", 0, "stderr", "/x/torch/_tensor.py:9: UserWarning: Failed to initialize NumPy: No module named numpy")
    last.note("m", 0, "stderr", "  cpu = _conversion_method_template(device=torch.device('cpu'))")
    assert last.get(("m", 0)).endswith("UserWarning: Failed to initialize NumPy: No module named numpy")
    last.note("m", 0, "stdout", "loss 0.25")
    last.note("m", 0, "stderr", "/x/a.py:3: DeprecationWarning: old")
    last.note("m", 0, "stderr", "  old()")
    last.note("m", 0, "stderr", "USDT:2026-12-04 19:19:43 10305:10305 Handler.cpp:52] profiler_start")
    last.note("m", 0, "stdout", "   ")
    assert last.get(("m", 0)) == "loss 0.25"
    last.note("m", 0, "stderr", "RuntimeError: real trouble")
    assert last.get(("m", 0)) == "RuntimeError: real trouble"
    last.forget("m")
    assert last.get(("m", 0)) == ""
