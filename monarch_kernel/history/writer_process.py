"""A controller's writer process: the controller's history batches are written to Parquet by a
small process of its own, so that the controller (the kernel, a user's script) never loads
pyarrow, numpy or pandas to record, and its exit never waits for the files to be written.

It is started at the first batch that has something in it (``python -m
monarch_kernel.history.writer_process``, a fresh interpreter, not a fork of the controller),
reads the batches from its stdin, a pipe only the controller holds, and exits by itself when
that pipe closes (its controller exited, or was killed, or let it go after ``IDLE_S``
without a batch: it then holds no memory while nothing is recorded), after writing what it got.  A
``flush()`` in the controller waits for its acknowledgement, so a query sees every row
recorded before it.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from ..runtime.hosting import config, private_files
from . import pending, places
from .parquet_files import Batch, ParquetFiles

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<Q?")  # a frame's length, and whether its writing is to be acknowledged
ACK = b"k"
ACK_TIMEOUT = 300.0  # a flush() waits this long for its batch to be written
IDLE_S = config.seconds("history_writer_idle")  # a writer process given no batch this long is let go
NICE = 10  # the writer's CPU priority: about a tenth of a busy rank's share (``_background``)
LOG = "writer.log"  # in the history's root: what a writer process says (a file could not be written)


class WriterProcess:
    """The controller's end: batches pickled into the writer process's pipe (the ``Sink`` of a
    controller's ``HistoryWriter``)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._going: list[subprocess.Popen] = []  # those let go, maybe still writing their last batch
        self._last = 0.0  # when the last batch was given
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The writer process's pid, None before the first batch."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def write(self, batch: Batch | None, wait: bool) -> None:
        with self._lock:
            for proc in [p for p in self._going if p.poll() is not None]:  # reaped: no zombie left
                self._gone(proc)
            for proc in list(self._going) if wait else ():  # what it was given is written once it has exited
                proc.wait(ACK_TIMEOUT)
                self._gone(proc)
            if batch is None and not wait and self._proc is not None and time.monotonic() - self._last > IDLE_S:
                self._let_go()
            if batch is None and (self._proc is None or not wait):
                return  # nothing new, and nothing given before to wait for
            if batch is not None:
                self._last = time.monotonic()
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            frame = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                proc.stdin.write(_HEAD.pack(len(frame), wait) + frame)
                proc.stdin.flush()
                if wait:
                    ready, _w, _x = select.select([proc.stdout], [], [], ACK_TIMEOUT)
                    if not ready:
                        raise TimeoutError(f"the history's writer process (pid {proc.pid}) wrote nothing for "
                                           f"{ACK_TIMEOUT:g} s: is the disk under the history_dir setting stuck?")
                    if os.read(proc.stdout.fileno(), 1) != ACK:
                        raise EOFError("it exited")
            except (OSError, EOFError) as e:
                self._proc = None  # the next batch starts another one
                self._end(proc)
                raise RuntimeError(f"the history's writer process (pid {proc.pid}) failed ({e!r}); "
                                   f"{LOG} in the history's folder says why; the next batch starts another") from e

    def start(self) -> None:
        """Start the writer process now, if none runs (a spawn begins: it loads pyarrow while
        the ranks start, not while their first calls run)."""
        with self._lock:
            self._last = time.monotonic()
            self._started()

    def close(self) -> None:
        """No more batches: it writes what it has and exits by itself (not waited for)."""
        with self._lock:
            self._let_go()

    def _let_go(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()  # it writes what it got, and exits
            except OSError:
                pass
            self._going.append(proc)

    def _gone(self, proc: subprocess.Popen) -> None:
        if proc.stdout is not None:
            proc.stdout.close()
        self._going.remove(proc)

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is not None:  # it died (writer.log says why)
            self._end(self._proc)
            self._proc = None
        if self._proc is None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            # a session of its own: a signal to the controller's group (Jupyter ends a kernel so)
            # must not end it before it has written what it was given; the pipe ends it
            # its stderr is a file of the history's, never the controller's: whoever reads the
            # controller's output to its end (``subprocess.run(..., capture_output=True)``) must
            # not wait for the writer too
            log_fd = _log_file()
            try:
                self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=log_fd, env=env, close_fds=True,
                                              start_new_session=True)
            finally:
                if log_fd != subprocess.DEVNULL:
                    os.close(log_fd)
            _background(self._proc.pid)
            marker = pending.mark(places.history_root(), self._proc.pid)
            frame = pickle.dumps(str(marker or ""), protocol=pickle.HIGHEST_PROTOCOL)
            assert self._proc.stdin is not None
            self._proc.stdin.write(_HEAD.pack(len(frame), False) + frame)  # first frame: its marker
        return self._proc

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


def _background(pid: int) -> None:
    """The writer runs at a lower CPU priority (nice ``NICE``) from before it loads pyarrow: on a
    busy machine the ranks and the controller beside it come first.  Not the lowest (19): with
    every core busy, that gets it under 1% of the machine, less than 100,000 lines a second
    need, and what it cannot write would gather in memory without end."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICE)
    except (OSError, AttributeError):  # gone already, or a platform without it: it runs as it is
        pass


def _log_file() -> int:
    """The writer's stderr: ``writer.log`` (0600) in the history's root, appended; where that
    cannot be opened, nothing."""
    try:
        root = str(places.history_root())
        private_files.private_dir(root, parents=False)
        return os.open(os.path.join(root, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)
    except OSError:
        return subprocess.DEVNULL


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        part = os.read(fd, min(n - got, 1 << 20))
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _read(fd: int, got: queue.SimpleQueue) -> None:
    """Frames from the controller as they come (its pipe never fills while a batch is being
    written), then None: the pipe closed, or its controller is gone."""
    controller = os.getppid()
    while True:
        ready, _w, _x = select.select([fd], [], [], 1.0)
        if not ready:
            if os.getppid() != controller:  # gone, though a process it forked holds the pipe
                break
            continue
        head = _read_exactly(fd, _HEAD.size)
        if head is None:
            break
        size, wait = _HEAD.unpack(head)
        frame = _read_exactly(fd, size)
        if frame is None:
            break
        got.put((pickle.loads(frame), wait))
    got.put(None)


class _NotNeeded:
    """pyarrow imports numpy, and pandas at its first array, only to ask whether values are
    theirs; they never are here (pyarrow needs neither since 16).  Without them this process
    starts on a third of the CPU (0.1 s instead of 0.3 s: numpy's BLAS starts its threads) and
    holds 40 MiB less."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("pandas", "numpy"):
            raise ImportError(f"{name} is not loaded in the history's writer process")


def main() -> None:
    """The writer process: batches from stdin until it closes, or its controller is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel's interrupt reaches its process group
    sys.meta_path.insert(0, _NotNeeded())
    logging.basicConfig(format="%(message)s")
    got: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(sys.stdin.fileno(), got), name="monarch-history-read", daemon=True).start()
    files = ParquetFiles()
    first = got.get()
    if first is None:  # its controller was gone before it said anything: nothing to write, nothing to wait for
        return
    marker = first[0] if isinstance(first[0], str) else ""
    import pyarrow.compute  # noqa: F401  (loaded now, before its first batch: see WriterProcess.start)
    import pyarrow.parquet  # noqa: F401
    try:
        _write(got, files)
    finally:
        if marker:
            pending.unmark(marker)  # all written: a query elsewhere need not wait for it


def _write(got: queue.SimpleQueue, files: ParquetFiles) -> None:
    while (item := got.get()) is not None:
        batch, wait = item
        if batch is not None:
            try:
                files.write(batch)
            except Exception as e:  # noqa: BLE001  (a full disk must not end the writer: say it, go on)
                log.warning("monarch_kernel: the history could not be written under %s: %r", batch.root, e)
        if wait:
            os.write(sys.stdout.fileno(), ACK)


if __name__ == "__main__":
    main()
