"""Ranks' stdout and stderr, cut into lines as the template (or host agent) forwards what it
read from the pipes their file descriptors 1 and 2 point at.

Captured at the fd level, so C extensions and child processes are caught too.  Lines go to
a sink (the kernel plugs in its own), or, to a sink with a ``write`` method, the text as it
comes (a line not yet ended shows at once); the last stderr lines of each rank are kept for
death reports.  Every whole line also goes to the recorders (the runtime's ``record`` hooks:
the history), and a line that starts with ``CONTROL_MARK`` (a rank's message for the controller
alone, e.g. a metric) goes to them only, never to the sink.  Runs on the IO thread and never
blocks; the work per byte is constant however long a line is, and no line is held whole
past ``config.max_line()`` bytes (a longer one reaches the sink as pieces of that size).
"""

from __future__ import annotations

import codecs
import collections
import logging
import sys
from collections.abc import Callable

from .. import config
from ..diagnostics import PROCESS_STDERR

log = logging.getLogger(__name__)
# sink(mesh_name, rank, stream, line) where stream is "stdout" or "stderr".
Sink = Callable[[str, int, str, str], None]

# each recorder(mesh_name, rank, stream, whole lines as bytes) where stream is "stdout", "stderr" or "control"
Recorders = Callable[[], list]
# What starts a line a rank writes for the controller alone (``monarch_kernel.metric``): two ASCII
# separators no text prints, then a word.
CONTROL_MARK = b"\x1e\x1fmonarch:"
# What a rank's console writes, as one write, after each cell: this, the cell's token (32 hex
# digits) and a newline.  The kernel takes it for the cell's end (only with a token it waits
# for); the history drops it.  Shown nowhere.
SYNC_MARK = "\x1emonarch-sync "
SYNC_PATTERN = "\x1emonarch-sync [0-9a-f]{32}"
_MARK_STARTS = tuple(CONTROL_MARK[:n] for n in range(len(CONTROL_MARK) - 1, 0, -1))  # a chunk may end in one
TAIL_LINES = 20
TAIL_CHARS = 4096  # a death report quotes at most this much of each stderr line


def print_sink(mesh: str, rank: int, stream: str, line: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    try:
        out.write(f"[rank {rank}] {line}\n")
        out.flush()
    except (ValueError, OSError):  # the controller's own stream is closed
        pass


def _char_boundary(data: bytes, cut: int) -> int:
    """``cut`` moved back (at most 3 bytes) so it does not split a UTF-8 character."""
    if cut >= len(data):
        return cut
    for back in range(4):
        if cut - back <= 0:
            break
        if data[cut - back] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return cut - back
    return cut


class LineReader:
    """One rank's stream, as the chunks its template (or host agent) forwards arrive:
    ``feed(data)`` calls ``sink`` per complete line (or per piece of a line longer than
    ``max_line`` bytes); ``close()`` sends what is left.  A sink with a ``write(mesh, rank,
    stream, text)`` method gets the text of each chunk instead, whole characters only, and
    cuts it into lines itself.  It holds no file descriptor, so the controller's open files do
    not grow with its ranks."""

    def __init__(self, mesh: str, rank: int, stream: str, sink: Callable[[], Sink],
                 recorders: Recorders = list):
        self.mesh, self.rank, self.stream = mesh, rank, stream
        self._sink = sink
        self._recorders = recorders
        self._record: list = []  # this chunk's recorders
        self._unended: list[bytes] = []  # for them: the end of the last chunk, a line not yet ended
        self._unended_size = 0
        self._control = b""  # a control line not yet ended
        self._parts: list[bytes] = []  # the line being read, not yet ended by a newline
        self._held = 0  # bytes in _parts
        self._max = config.max_line()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.closed = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._to_sink = True  # whether lines go to the sink (not when it takes text as it comes)

    def feed(self, data: bytes) -> None:
        if self.closed or not data:
            return
        self._record = self._recorders()
        if self._control or CONTROL_MARK in data or data.endswith(_MARK_STARTS):
            data = self._controls(self._control + data)
        if self._record and data:
            self._deliver(data)
        write = getattr(self._sink(), "write", None)
        self._to_sink = write is None
        if write is not None:
            self._write(write, self._decoder.decode(data))
            if self.stream != "stderr":
                return  # only stderr's lines are kept (for death reports)
        self._feed(data)

    def _deliver(self, data: bytes) -> None:
        """The whole lines this chunk ends, as their bytes, to the recorders, in one call each
        (they must only append; they cut lines on their own thread): no work per line here."""
        nl = data.rfind(b"\n")
        if nl < 0:
            self._unended.append(data)
            self._unended_size += len(data)
            if self._unended_size <= self._max:
                return
            whole, self._unended, self._unended_size = b"".join(self._unended) + b"\n", [], 0  # a piece
        else:
            whole = b"".join([*self._unended, data[:nl + 1]]) if self._unended else data[:nl + 1]
            rest = data[nl + 1:]
            self._unended, self._unended_size = ([rest], len(rest)) if rest else ([], 0)
        for record in self._record:
            self._call(record, self.stream, whole)

    def _controls(self, data: bytes) -> bytes:
        """``data`` without its control lines, which go to the recorders; one not yet ended
        is held for the next chunk."""
        self._control = b""
        kept, bodies = [], []
        start = 0
        while (at := data.find(CONTROL_MARK, start)) >= 0:
            end = data.find(b"\n", at)
            kept.append(data[start:at])
            if end < 0:
                self._control = data[at:]
                start = len(data)
                break
            bodies.append(data[at + len(CONTROL_MARK):end])
            start = end + 1
        rest = data[start:]
        if not self._control and rest.endswith(_MARK_STARTS):  # the mark's first bytes: wait for the rest
            held = next(m for m in _MARK_STARTS if rest.endswith(m))
            self._control, rest = held, rest[:-len(held)]
        kept.append(rest)
        for record in self._record if bodies else ():
            self._call(record, "control", b"".join(b + b"\n" for b in bodies))
        return b"".join(kept)

    def _call(self, record, stream: str, lines: bytes) -> None:
        try:
            record(self.mesh, self.rank, stream, lines)
        except Exception as e:  # a broken recorder must not stop the IO thread
            log.error("monarch_kernel: output recorder failed: %r", e, extra=PROCESS_STDERR)

    def _write(self, write, text: str) -> None:
        if not text:
            return
        try:
            write(self.mesh, self.rank, self.stream, text)
        except Exception as e:  # a broken sink must not stop the IO thread
            log.error("monarch_kernel: output sink failed: %r", e, extra=PROCESS_STDERR)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        write = getattr(self._sink(), "write", None)
        if write is not None:
            self._write(write, self._decoder.decode(b"", final=True))
        if self._parts:
            raw = b"".join(self._parts)
            self._parts, self._held = [], 0
            self._emit(raw)
        if self._unended:
            self._deliver(b"\n")

    def _emit(self, raw: bytes, whole: bool = True) -> None:
        line = raw.decode("utf-8", "replace")
        if whole:
            line = line.rstrip("\r")
        if self.stream == "stderr":
            self.tail.append(line if len(line) <= TAIL_CHARS else line[:TAIL_CHARS] + "…")
        if not self._to_sink:
            return
        try:
            self._sink()(self.mesh, self.rank, self.stream, line)
        except Exception as e:  # a broken sink must not stop the IO thread
            log.error("monarch_kernel: output sink failed: %r", e, extra=PROCESS_STDERR)

    def _feed(self, data: bytes) -> None:
        """Split one chunk into lines; each byte is looked at a bounded number of times."""
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if self._parts:
                self._parts.append(data[start:nl])
                raw = b"".join(self._parts)
                self._parts.clear()
                self._held = 0
            else:
                raw = data[start:nl]
            self._line(raw, ended=True)
            start = nl + 1
        if start < len(data):
            self._parts.append(data[start:] if start else data)
            self._held += len(data) - start
            if self._held > self._max:
                self._line(b"".join(self._parts), ended=False)

    def _line(self, raw: bytes, ended: bool) -> None:
        """Send a line on, as pieces of at most ``max_line`` bytes; of a line not yet
        ended, keep the last part (1 to ``max_line`` bytes) for the next read."""
        start = 0
        while len(raw) - start > self._max:
            cut = _char_boundary(raw, start + self._max)
            self._emit(raw[start:cut], whole=False)
            start = cut
        rest = raw[start:] if start else raw
        if ended:
            self._emit(rest)
        else:
            self._parts = [rest] if rest else []
            self._held = len(rest)
