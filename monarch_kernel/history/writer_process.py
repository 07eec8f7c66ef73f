"""A controller's history writer: the controller (or a host agent) spools each batch to disk
itself (``spool_files``: about a copy, and nothing lost if it is killed), and a small
process of its own turns the spool into Parquet (``convert``) at the lowest CPU priority,
when the CPU is idle, so that the ranks' work beside it pays next to nothing while it runs.
The controller never loads pyarrow, numpy or pandas to record, and its exit never waits for
the files to be written: a query converts whatever is still spooled first.

The process (``python -m monarch_kernel.history.writer_process``, a fresh interpreter, not
a fork of the controller) is started by the first batch with ranks' lines, or once what is
spooled is past ``HOLD_BYTES`` or has waited ``HOLD_S``: a quiet mesh's spawn, events and
samples wait on disk (a query, a listing and the controller's exit convert them), so that
it starts no process loading pyarrow beside the ranks' first calls.  It is told of each
spooled batch through its stdin, a pipe only the controller holds, and exits by itself when
that pipe closes (its controller exited, or was killed, or let it go after ``IDLE_S``
without a batch): at once, as what it was told of is on disk.
Past ``spool_bound()`` of spooled bytes (the CPU is never idle) the controller lets it go
and starts one at ``NICE_BEHIND``, back to ``NICE`` once the spool is under half of it; at
the controller's exit, what is still spooled gets one at ``NICE_BEHIND`` too.  Those
(``DRAIN``) convert what they were told of before they exit.
"""

from __future__ import annotations

import logging
import os
import pathlib
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
from . import places, size_cap, spool_files
from .parquet_files import Batch

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<Q")  # a frame's length
IDLE_S = config.seconds("history_writer_idle")  # a writer process given no batch this long is let go
HOLD_S = config.seconds("history_hold")  # batches without lines wait this long on disk to be converted ...
HOLD_BYTES = 1 << 20  # ... while the spool holds less than this
NICE = 19  # the writer's CPU priority while it keeps up: it converts when the CPU is idle
NICE_BEHIND = 10  # ... once the spool is past its bound: about a tenth of a busy rank's share
SPOOL_MOST = 256 << 20  # the spool's bound: at most this (a minute of 100,000 lines/s) ...
CAP_EVERY_S = config.seconds("history_cap_every")  # the recording side counts the host's Parquet files again
DRAIN = "--drain"  # a writer at NICE_BEHIND: when its pipe closes, it converts what it was told of, then ends
LOG = "writer.log"  # in the history's root: what a writer process says (a file could not be written)


def spool_bound(max_bytes: int) -> int:
    """... and at most a quarter of the host's size cap."""
    return min(SPOOL_MOST, max_bytes // 4)


class WriterProcess:
    """The recording end (the ``Sink`` of a controller's, or an agent's, ``HistoryWriter``):
    batches spooled, their converter told."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._nice = NICE
        self._going: list[subprocess.Popen] = []  # those let go, maybe still converting
        self._last = 0.0  # when the last batch was given
        self._parquet: tuple[float, int] | None = None  # (when counted, bytes of this host's Parquet files)
        self._told: tuple[str, str] | None = None  # the spool the last batch went to
        self._held: float | None = None  # since when batches spooled there wait, no converter told
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The writer process's pid, None before the first batch."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def write(self, batch: Batch | None, wait: bool) -> None:
        """Spool ``batch`` (on disk when this returns, whatever ``wait``), and tell the converter."""
        with self._lock:
            for proc in [p for p in self._going if p.poll() is not None]:  # reaped: no zombie left
                self._gone(proc)
            now = time.monotonic()
            if batch is None:
                if self._held is not None and self._told is not None and now - self._held >= HOLD_S:
                    self._held = None
                    self._tell(self._started(), self._told)
                elif self._proc is not None and now - self._last > IDLE_S:
                    self._let_go()
                return
            self._last = now
            path = spool_files.put(batch)
            spooled = sum(size for _t, _p, size in spool_files.sizes(batch.root, batch.host))
            self._keep_cap(batch, spooled, path)
            self._told = (batch.root, batch.host)
            if not batch.chunks and spooled < HOLD_BYTES and (self._held is None or now - self._held < HOLD_S):
                if self._held is None:
                    self._held = now
                return  # no lines: it waits on disk (a query or a listing converts it first)
            self._held = None
            bound = spool_bound(batch.max_bytes)
            nice = NICE_BEHIND if spooled > bound else NICE if spooled < bound // 2 else self._nice
            if nice != self._nice:
                self._let_go()
                self._nice = nice
            self._tell(self._started(), self._told)

    def _keep_cap(self, batch: Batch, spooled: int, spared: pathlib.Path) -> None:
        """The host's history (the spool too) under its cap, even while nothing converts (the
        Parquet files counted again every ``CAP_EVERY_S``); what went is said in a batch of its own."""
        if spooled < min(HOLD_BYTES, batch.max_bytes // 4):
            # too little to matter, and whoever converts it caps the host then (``ParquetFiles``):
            # no count of the host's files (tens of ms of the GIL for thousands, beside calls)
            return
        root = pathlib.Path(batch.root)
        now = time.monotonic()
        if self._parquet is None or now - self._parquet[0] > CAP_EVERY_S:
            self._parquet = (now, size_cap.parquet_bytes(root, batch.host))
        if self._parquet[1] + spooled <= batch.max_bytes:
            return
        _left, dropped = size_cap.trim(root, batch.host, batch.max_bytes, spared)
        self._parquet = None
        if dropped:
            at = time.time_ns() // 1000
            said = Batch(batch.root, batch.host, batch.max_bytes, batch.pid)
            for d in dropped:
                run = d.folder.parent.name if d.folder is not None and places.is_run(d.folder.parent.name) else d.run
                said.rows[("events", d.mesh, run)] = [(at, batch.host, None, "history_dropped", None, None,
                                                       d.detail(batch.max_bytes))]
                if d.meta:  # the run listed still, though the batches that said so went
                    said.metas[(d.mesh, run)] = d.meta
                    if run is not None:  # and at once: a converter behind the cap may never list it
                        places.write_first_meta(places.host_dir(root, d.mesh, run, batch.host),
                                                places.meta_of(d.mesh, run, {}, d.meta, batch.host, batch.pid))
            spool_files.put(said)

    def start(self) -> None:
        """Start the writer process now, if none runs (it converts what it is told of next)."""
        with self._lock:
            self._last = time.monotonic()
            self._started()

    def close(self) -> None:
        """No more batches (the recorder exits): the writer at idle ends, and what is still
        spooled is converted by one at ``NICE_BEHIND`` that ends once it has (not waited for)."""
        with self._lock:
            told = self._told
            self._let_go()
            if told is not None and spool_files.pending(*told):
                self._nice = NICE_BEHIND
                self._tell(self._started(), told)
                self._let_go()

    def _tell(self, proc: subprocess.Popen, what: object) -> None:
        """One short frame (under PIPE_BUF: written whole or not at all), never waiting: a
        writer starved so long that its pipe is full has been told of this spool already."""
        frame = pickle.dumps(what, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            assert proc.stdin is not None
            os.write(proc.stdin.fileno(), _HEAD.pack(len(frame)) + frame)
        except BlockingIOError:
            pass
        except OSError as e:  # it died (writer.log says why): the batch is spooled; the next starts another
            self._proc = None
            self._end(proc)
            log.warning("monarch_kernel: the history's writer process (pid %s) failed (%r); %s in the history's "
                        "folder says why; what it was given is spooled, the next batch starts another",
                        proc.pid, e, LOG)

    def _let_go(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()  # it converts what is spooled, and exits
            except OSError:
                pass
            self._going.append(proc)

    def _gone(self, proc: subprocess.Popen) -> None:
        self._going.remove(proc)

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is not None:  # it died (writer.log says why)
            self._end(self._proc)
            self._proc = None
        if self._proc is None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            # a session of its own: a signal to the controller's group (Jupyter ends a kernel so)
            # must not end it before it has converted the spool; the pipe ends it
            # its stderr is a file of the history's, never the controller's: whoever reads the
            # controller's output to its end (``subprocess.run(..., capture_output=True)``) must
            # not wait for the writer too
            log_fd = _log_file()
            try:
                mode = [] if self._nice == NICE else [DRAIN]
                self._proc = subprocess.Popen([sys.executable, "-m", __name__, *mode], stdin=subprocess.PIPE,
                                              stdout=subprocess.DEVNULL, stderr=log_fd, env=env, close_fds=True,
                                              start_new_session=True)
            finally:
                if log_fd != subprocess.DEVNULL:
                    os.close(log_fd)
            _background(self._proc.pid, self._nice)
            assert self._proc.stdin is not None
            os.set_blocking(self._proc.stdin.fileno(), False)
        return self._proc

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass


def _background(pid: int, nice: int) -> None:
    """The writer runs at CPU priority ``nice`` from before it loads pyarrow: on a busy
    machine the ranks and the controller beside it come first.  At ``NICE`` it is also
    Linux's SCHED_IDLE: nice 19 alone still takes a few % of a core from busy ranks, this
    only what they leave.  Where Linux groups each session for the scheduler (autogroup, on
    by default), the writer's session of its own would otherwise take a session's fair share
    beside the ranks' whatever its nice: that group is given ``nice`` too."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        if nice == NICE and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # gone already, or a platform without it: it runs as it is
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:  # its own: it leads a session of its own
            f.write(str(nice))
    except OSError:  # no autogroup here (or it is gone): the nice above is all there is
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


def _read(fd: int, got: queue.SimpleQueue, committing: threading.Lock | None) -> None:
    """(root, host) of each batch spooled, as the controller says them, then None: the pipe
    closed, or its controller is gone.  Then a writer at idle (``committing``: held while it
    puts a batch's files in place) ends at once: starved, it could take minutes to finish a
    batch, which is on disk and whoever comes next converts; what it was building is swept."""
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
        frame = _read_exactly(fd, _HEAD.unpack(head)[0])
        if frame is None:
            break
        got.put(pickle.loads(frame))
    if committing is not None:
        committing.acquire()
        os._exit(0)
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
    """The writer process: converts the spool it is told of until its stdin closes, or its
    controller is gone; with ``DRAIN``, then what is left there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel's interrupt reaches its process group
    sys.meta_path.insert(0, _NotNeeded())
    logging.basicConfig(format="%(message)s")
    got: queue.SimpleQueue = queue.SimpleQueue()
    committing = None if DRAIN in sys.argv[1:] else threading.Lock()
    threading.Thread(target=_read, args=(sys.stdin.fileno(), got, committing), name="monarch-history-read",
                     daemon=True).start()
    from .convert import Converter

    converter = Converter(committing)
    told: set[tuple[str, str]] = set()
    item = got.get()
    if item is None:  # its controller was gone before it said anything: nothing to wait for
        return
    import pyarrow.compute  # noqa: F401  (loaded now, at its low priority, before it converts)
    import pyarrow.parquet  # noqa: F401

    while item is not None:
        told.add(item)
        while True:  # all it was told of since, at once
            try:
                item = got.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            told.add(item)
        for root, host in sorted(told):
            try:
                converter.convert(root, host)
            except Exception as e:  # noqa: BLE001  (a full disk must not end the writer: say it, go on)
                log.warning("monarch_kernel: the history could not be written under %s: %r", root, e)
        if item is not None:
            item = got.get()


if __name__ == "__main__":
    main()
