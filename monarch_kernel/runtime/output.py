"""Ranks' stdout and stderr, read from the pipes their file descriptors 1 and 2 point at.

Captured at the fd level, so C extensions and child processes are caught too.  Lines go to
a sink (the kernel plugs in its own); the last stderr lines of each rank are kept for death
reports.  Runs on the IO thread and never blocks.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Callable

# sink(mesh_name, rank, stream, line) where stream is "stdout" or "stderr".
Sink = Callable[[str, int, str, str], None]

TAIL_LINES = 20


def print_sink(mesh: str, rank: int, stream: str, line: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    try:
        out.write(f"[rank {rank}] {line}\n")
        out.flush()
    except (ValueError, OSError):  # the controller's own stream is closed
        pass


class PipeReader:
    """Reads one rank's stream; calls ``sink`` per complete line and once at EOF."""

    def __init__(self, loop, fd: int, mesh: str, rank: int, stream: str,
                 sink: Callable[[], Sink], on_eof: Callable[[], None]):
        self.loop, self.fd, self.mesh, self.rank, self.stream = loop, fd, mesh, rank, stream
        self._sink = sink
        self._on_eof = on_eof
        self._partial = b""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.closed = False
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if self.stream == "stderr":
            self.tail.append(line)
        try:
            self._sink()(self.mesh, self.rank, self.stream, line)
        except Exception as e:  # a broken sink must not stop the IO thread
            print(f"monarch_kernel: output sink failed: {e!r}", file=sys.__stderr__)

    def _read_once(self) -> bool:
        """Read one chunk; False when nothing more is available now."""
        if self.closed:
            return False
        try:
            data = os.read(self.fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for raw in lines:
            self._emit(raw)
        return True

    def _readable(self) -> None:
        self._read_once()

    def drain(self) -> None:
        """Read whatever is buffered right now (used before reporting a death)."""
        while self._read_once():
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._partial:
            self._emit(self._partial)
            self._partial = b""
        try:
            self.loop.remove_reader(self.fd)
        except Exception:  # loop already closed at interpreter exit
            pass
        os.close(self.fd)
        self._on_eof()
