"""A rank's control lines (``monarch_kernel.metric``'s) reach the recorders and never the
output sink, however the pipe cuts them; whole lines reach the recorders a chunk at a time, as bytes."""

from __future__ import annotations

import pytest

from monarch_kernel.runtime.spawn.rank_output import CONTROL_MARK, LineReader

pytestmark = pytest.mark.timeout(30)


class TextSink:
    """A sink that takes text as it comes (the kernel's kind)."""

    def __init__(self):
        self.text = ""

    def __call__(self, mesh, rank, stream, line):
        raise AssertionError("a text sink is not given lines")

    def write(self, mesh, rank, stream, text):
        self.text += text


@pytest.mark.parametrize("text_sink", [False, True])
def test_control_lines_go_to_recorders_only_whatever_the_cuts(text_sink):
    shown: list[str] = []
    sink = TextSink() if text_sink else (lambda mesh, rank, stream, line: shown.append(line))
    recorded: list[tuple[str, bytes]] = []
    reader = LineReader("m", 3, "stdout", lambda: sink,
                        lambda: [lambda mesh, rank, stream, lines: recorded.append((stream, lines))])
    data = b"one\n" + CONTROL_MARK + b'metric {"n":"loss","v":0.5,"s":1,"t":7}\ntwo\nthr' + b"ee\n"
    cut = data.index(CONTROL_MARK) + 5  # inside the control line
    for part in (data[:cut], data[cut:cut + 20], data[cut + 20:]):
        reader.feed(part)
    reader.close()
    out = sink.text.splitlines() if text_sink else shown
    assert out == ["one", "two", "three"]
    assert ("control", b'metric {"n":"loss","v":0.5,"s":1,"t":7}\n') in recorded
    assert b"".join(lines for stream, lines in recorded if stream == "stdout") == b"one\ntwo\nthree\n"


def test_the_cells_end_marker_is_never_a_recorded_line(tmp_path):
    """The console's end-of-cell marker (alone on its line, or after a partial line) reaches the
    recorders with the rank's lines; the history keeps the text around it and drops the marker."""
    from monarch_kernel.history import open_history
    from monarch_kernel.history.writer import HistoryWriter
    from monarch_kernel.runtime.spawn.rank_output import SYNC_MARK

    writer = HistoryWriter(tmp_path, "node", flush_s=60, max_bytes=1 << 30)
    token = "0123456789abcdef" * 2
    writer.lines("m", 0, "stdout", f"step 1\n{SYNC_MARK}{token}\nhalf{SYNC_MARK}{token}\n".encode())
    writer.lines("m", 1, "stdout", b"printed monarch-sync by hand\n")
    writer.flush()
    writer.close()
    rows = open_history("m", root=tmp_path).sql("SELECT rank, line FROM lines ORDER BY rank, time").values.tolist()
    assert rows == [[0, "step 1"], [0, "half"], [1, "printed monarch-sync by hand"]]


def test_samples_alone_wait_for_more_before_they_are_written(tmp_path):
    """An idle mesh's periodic samples start no writer every few seconds: the periodic flush
    holds samples alone (``history_hold``); anything else recorded, or a query, writes them."""
    from monarch_kernel.history.writer import HistoryWriter

    writer = HistoryWriter(tmp_path, "node", flush_s=60, max_bytes=1 << 30)
    try:
        writer.add("samples", "m", (1, "node", 0, 42, 1.0, 30.0, None, None))
        writer.flush(hold_samples=True)  # what the writer's thread does every history_flush
        assert not list(tmp_path.rglob("*.parquet"))
        writer.lines("m", 0, "stdout", b"a line\n")
        writer.flush(hold_samples=True)
        assert {p.name.split("-")[0] for p in tmp_path.rglob("*.parquet")} == {"samples", "lines"}
    finally:
        writer.close()
