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
