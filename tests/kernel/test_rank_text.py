"""A rank's stream read as a terminal shows it, without processes: ``\\r``, ``\\b`` and ANSI
codes on the rank's own line, markers taken out only with a token the kernel waits for, and
the notebook sink's last line (a line being written, the progress line) drawn and taken away."""

from __future__ import annotations

import contextvars
import re
import threading
import time

import pytest
from support.kernels import as_shown

from monarch_kernel.console.console import SYNC
from monarch_kernel.kernel.output import CollapsingSink
from monarch_kernel.kernel.rank_text import RankText, TermLine

pytestmark = pytest.mark.timeout(60)
TOKEN = "ab" * 16


def rendered(*chunks: str) -> str:
    line = TermLine()
    for chunk in chunks:
        line.write(chunk)
    return line.text()


@pytest.mark.parametrize("chunks, shown", [
    (["progress 50%\r", "progress 100%"], "progress 100%"),
    (["long text eta 0:00:01\r", "\x1b[2Kshort"], "short"),  # pip's bar: erase the line, draw again
    (["abc\b\bX"], "aXc"),
    (["\x1b[?25l 10%\r 20%\x1b[?25h"], " 20%"),  # the cursor hidden and shown: nothing to show
    (["\x1b[31mred\x1b[0m ok"], "\x1b[31mred\x1b[0m ok"),  # colours are kept
    (["\x1b[31mstill red"], "\x1b[31mstill red\x1b[0m"),  # ... and never run into the next line
    (["50%\x1b", "[0m\r100%"], "\x1b[0m100%"),  # an escape cut between two chunks
    (["\x1b]0;title\x07text"], "text"),
    (["abcdef\x1b[3G", "X"], "abXdef"),
])
def test_a_line_as_a_terminal_shows_it(chunks, shown):
    assert rendered(*chunks) == shown


def test_markers_end_the_line_before_them_and_only_known_tokens_count():
    rt = RankText(lambda token: token == TOKEN, max_chars=1 << 20)
    assert rt.feed("abc") == [] and rt.open() == "abc"
    marker = SYNC + TOKEN + "\n"
    assert rt.feed(marker[:7]) == []  # a marker cut by a chunk's end waits for its rest
    assert rt.feed(marker[7:] + "next\n") == [("line", "abc"), ("sync", TOKEN), ("line", "next")]
    fake = SYNC + "cd" * 16
    assert rt.feed(fake + "\n") == [("line", fake)]  # a token nobody waits for is the user's text
    assert rt.feed("x\r" + marker) == [("line", "x"), ("sync", TOKEN)]


def test_watchers_and_last_lines_get_the_line_as_shown():
    sink = CollapsingSink(None, window=0.01)
    seen = []
    sink.watchers.append(lambda *a: seen.append(a))
    try:
        sink.write("m", 0, "stdout", "progress 50%\r")
        assert seen == [] and sink.last_lines == {}
        sink.write("m", 0, "stdout", "progress 100%\n")
        assert seen == [("m", 0, "stdout", "progress 100%")]
        assert sink.last_lines == {("m", 0): "progress 100%"}
    finally:
        sink.close()


class Cell:
    def __init__(self):
        self.text = ""
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def shown(self) -> str:
        """As a notebook shows it, without the blanks that end a line."""
        with self.lock:
            return re.sub(" +(\n|$)", "\\1", as_shown(self.text))


def wait_for(what: str, predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def test_identical_open_lines_collapse_in_the_last_line_and_it_goes_at_the_end(monkeypatch):
    cell = Cell()
    monkeypatch.setattr("sys.stdout", cell)
    contextvars.ContextVar("cell").set(1)
    sink = CollapsingSink(None, window=0.01)
    sink.follow_cell()
    sink.expect(TOKEN)
    try:
        for r in (0, 1):
            sink.write("m", r, "stdout", " 40%|####      |\r")
        wait_for("the bar of both ranks", lambda: cell.shown() == "[ranks 0-1]  40%|####      |")
        sink.write("m", 0, "stdout", "100%|##########|\n")
        wait_for("rank 0's line above rank 1's bar",
                 lambda: cell.shown() == "[rank 0] 100%|##########|\n[rank 1]  40%|####      |")
        sink.progress("[mesh] 1 of 2 ranks finished (2 s)")
        sink.write("m", 1, "stdout", "100%|##########|\n" + SYNC + TOKEN + "\n")
        sink.write("m", 0, "stdout", SYNC + TOKEN + "\n")
        wait_for("the progress line last",
                 lambda: cell.shown().endswith("\n[mesh] 1 of 2 ranks finished (2 s)"))
        sink.progress("[mesh] 2 of 2 ranks finished (2 s)", final=True)
        assert sink.wait_synced(TOKEN, {("m", 0, "stdout"), ("m", 1, "stdout")}, 5)
        assert cell.shown().split("\n") == [
            "[rank 0] 100%|##########|", "[rank 1] 100%|##########|", ""]
    finally:
        sink.close()
