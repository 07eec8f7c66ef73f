"""What a process that owns ranks' output records into its host's history: their lines and
control lines (metrics), their spawns and deaths, and their CPU and memory at a low rate.
It plugs into the runtime's hooks (``record``, ``spawned``, ``death``) once per runtime,
when the process first spawns; nothing is recorded by importing this module.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time

from ..runtime.hosting import Runtime, config, proc_stats
from . import places
from .gather import gather_soon
from .writer import HistoryWriter, new_writer

log = logging.getLogger(__name__)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

_writer: list[HistoryWriter] = []  # this process's writer, made by the first install
_lock = threading.Lock()


def process_writer(create: bool = True, host: str | None = None, own_process: bool = True
                   ) -> HistoryWriter | None:
    """This process's history writer (made on first use if ``create``, for ``host``: by
    default this host's name), or None.  ``own_process``: its batches are spooled, and
    converted by a writer process (it never loads pyarrow to record); else written on its thread."""
    with _lock:
        if not _writer and create:
            _writer.append(new_writer(host=host, own_process=own_process))
            atexit.register(_at_exit)
        return _writer[0] if _writer else None


def record_lines(writer: HistoryWriter, mesh: str, rank: int, stream: str, lines: bytes) -> None:
    """A chunk of a rank's whole lines (the runtime's ``record`` hook): printed ones as lines,
    control ones (``metric``) as what they say."""
    if stream != "control":
        writer.lines(mesh, rank, stream, lines)
        return
    for line in lines.decode("utf-8", "replace").splitlines():
        word, _, body = line.partition(" ")
        if word == "metric":
            try:
                m = json.loads(body)
                step = m.get("s")
                writer.add("metrics", mesh, (int(m["t"]), rank, str(m["n"]), None if step is None else int(step),
                                             float(m["v"])))
            except (ValueError, KeyError, TypeError):
                log.warning("monarch_kernel: a malformed metric from rank %s of %s: %r", rank, mesh, body[:200])


def record_hook(writer: HistoryWriter):
    """``record_lines`` into ``writer`` as the runtime's ``record`` hook, printed lines one
    call from the writer (it runs for every chunk the IO thread reads)."""
    lines = writer.lines

    def record(mesh: str, rank: int, stream: str, data: bytes) -> None:
        if stream != "control":
            lines(mesh, rank, stream, data)
        else:
            record_lines(writer, mesh, rank, stream, data)

    return record


def now_us() -> int:
    return time.time_ns() // 1000


class Recorder:
    """The hooks of one runtime, writing to ``writer``."""

    def __init__(self, rt: Runtime, writer: HistoryWriter):
        self.rt, self.writer = rt, writer
        self.alive: dict[str, int] = {}  # mesh -> ranks not yet dead
        self.remote: set[str] = set()  # meshes with ranks on other hosts (their agents write their lines)
        self.failed: set[str] = set()
        self.runs: dict[str, str] = {}  # mesh id -> its run (``current_run`` of a ProcMesh)
        self.last_ticks: dict[tuple[str, int], tuple[int, float, int]] = {}
        self.record = record_hook(writer)
        self.handles = [rt.hooks.record.install(self.record), rt.hooks.spawned.install(self.spawned),
                        rt.hooks.death.install(self.death)]
        threading.Thread(target=self._sample_loop, name="monarch-history-samples", daemon=True).start()

    def spawned(self, proc_mesh) -> None:
        ref = proc_mesh.ref
        hosts = sorted(set(ref.hosts)) or [self.writer.host]
        self.alive[ref.name] = ref.size
        run = self.writer.run_of(ref.name)
        if run is not None:
            self.runs[ref.id] = run
        om = self.rt.owned_mesh(ref.id)
        if om is not None and om.links is not None:
            self.remote.add(ref.name)
        self.writer.mesh_info(ref.name, kind="job" if hosts != [self.writer.host] else "mesh", hosts=hosts,
                              state="running", ranks=ref.size)
        self.writer.add("events", ref.name, (now_us(), hosts[0] if len(hosts) == 1 else None, None, "spawn",
                                             None, None, f"{ref.size} rank(s) on {', '.join(hosts)}"))

    def death(self, mesh_id: str, rank: int, info) -> None:
        kind = "stop" if info.stopped else "exit"
        detail = info.how() if hasattr(info, "how") else ""
        if info.stderr_tail and not info.stopped:
            detail += "\n" + "\n".join(info.stderr_tail[-10:])
        self.writer.add("events", info.mesh, (now_us(), info.host, rank, kind, info.exitcode, info.signal, detail))
        if not info.stopped:
            self.failed.add(info.mesh)
        left = self.alive.get(info.mesh)
        if left is not None:
            om = self.rt.owned_mesh(mesh_id)  # its live ranks (a restarted one counts again)
            left = len(om.alive - {rank}) if om is not None else left - 1
            self.alive[info.mesh] = left
            if left <= 0:
                self.writer.mesh_info(info.mesh, state="failed" if info.mesh in self.failed else "ended")
                if info.mesh in self.remote:
                    gather_soon(info.mesh)  # the job's hosts may go next: their history comes home now

    def at_exit(self) -> None:
        """This process exits (its atexit runs before the runtime's, which ends the ranks):
        its meshes still running end with it, and the history says so."""
        for mesh, left in self.alive.items():
            if left > 0:
                self.writer.add("events", mesh, (now_us(), self.writer.host, None, "stop", None, None,
                                                 f"the controller (pid {os.getpid()}) exited: its {left} running "
                                                 f"rank(s) end with it"))
                self.writer.mesh_info(mesh, state="failed" if mesh in self.failed else "ended")

    def _sample_loop(self) -> None:
        """Every ``history_sample`` seconds (read each time: it may change), a sample."""
        while True:
            every = config.get("history_sample")
            time.sleep(every if every > 0 else 5.0)
            if every <= 0 or config.get("history_sample") <= 0:
                continue
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001  (a sample missed is no failure: say it, go on)
                log.debug("monarch_kernel: history sample failed: %r", e)

    def sample(self, timeout: float = 5.0) -> None:
        """One sample of every live rank of every mesh this process spawned, as ``%mesh top``'s."""
        for om in self.rt.owned_meshes():
            ranks = sorted(om.alive)
            if not ranks or om.stopping:
                continue
            done = proc_stats.sample(self.rt, om, ranks)
            if not done.wait(timeout) or done.error() is not None:
                continue
            got, now = done.result(), time.monotonic()
            for r, u in got.items():
                pid = om.pids[r]
                if u is None or pid is None:
                    continue
                self.add_sample(om.ref.name, r, om.ref.hosts[r] if om.ref.hosts else self.writer.host, pid, u, now)

    def add_sample(self, mesh: str, rank: int, host: str, pid: int, usage, now: float) -> None:
        ticks, rss_bytes, gpu_pct, gpu_used = usage[:4]
        before = self.last_ticks.get((mesh, rank))
        cpu = None
        if before is not None and before[2] == pid and now > before[1]:
            cpu = round(100.0 * (ticks - before[0]) / _CLK_TCK / (now - before[1]), 1)
        self.last_ticks[(mesh, rank)] = (ticks, now, pid)
        gpu, gpu_mib = (float(gpu_pct), float(gpu_used)) if gpu_pct >= 0 else (None, None)
        self.writer.add("samples", mesh, (now_us(), host, rank, pid, cpu, round(rss_bytes / (1 << 20), 1), gpu,
                                          gpu_mib))


_recorders: dict[int, Recorder] = {}


def _at_exit() -> None:
    with _lock:
        recorders = list(_recorders.values())
    for recorder in recorders:
        recorder.at_exit()
    if _writer:
        _writer[0].close()


def record_history(rt: Runtime) -> Recorder | None:
    """Record ``rt``'s meshes into this host's history (once per runtime; called when this
    process first spawns), unless the ``history`` setting is off."""
    if not config.get("record_history"):
        return None
    with _lock:
        got = _recorders.get(id(rt))
    if got is None:
        writer = process_writer()
        assert writer is not None
        got = Recorder(rt, writer)
        with _lock:
            _recorders[id(rt)] = got
    return got


def begin_run(mesh: str) -> str:
    """A new run of ``mesh``, which this process is about to spawn (again): its rows from now
    on go to that run's folders; the run id, for the hosts of a job to write under too."""
    writer = process_writer(create=False)
    return writer.begin_run(mesh) if writer is not None else places.new_run()


def current_run(name_or_mesh) -> str | None:
    """The run this process records a mesh under: a ``ProcMesh``'s own (a mesh replaced by
    another of its name keeps its run), a name's latest spawn here; None if it spawned none."""
    ref = getattr(name_or_mesh, "ref", None)
    if ref is not None:
        with _lock:
            recorders = list(_recorders.values())
        for recorder in recorders:
            if ref.id in recorder.runs:
                return recorder.runs[ref.id]
        name_or_mesh = ref.name
    writer = process_writer(create=False)
    if writer is None or not isinstance(name_or_mesh, str):
        return None
    return writer.run_of(name_or_mesh)


def record_event(mesh: str, kind: str, *, rank: int | None = None, detail: str = "", host: str | None = None,
                 code: int | None = None, signal: int | None = None) -> None:
    """Record a lifecycle event (an interrupt, a debugger stop, a watchdog alarm) of ``mesh``
    in this host's history, if this process records one."""
    writer = process_writer(create=False)
    if writer is not None:
        writer.add("events", mesh, (now_us(), host or writer.host, rank, kind, code, signal, detail))


def record_sample(mesh: str, rank: int, host: str | None, pid: int | None, cpu: float | None,
                  rss_mib: float | None, gpu: float | None = None, gpu_mib: float | None = None) -> None:
    """One rank's CPU and memory as ``%mesh top`` sampled them (a row of ``samples``), if this
    process records a history."""
    writer = process_writer(create=False)
    if writer is not None:
        writer.add("samples", mesh, (now_us(), host or writer.host, rank, pid, cpu, rss_mib, gpu, gpu_mib))


def record_stacks(mesh: str, rank: int, reason: str, stack: str, host: str | None = None) -> None:
    """Record a rank's stack dump (``reason``: ``watchdog``, ``stacks``)."""
    writer = process_writer(create=False)
    if writer is not None:
        writer.add("stacks", mesh, (now_us(), host or writer.host, rank, reason, stack))


def set_cell(label: str | None) -> None:
    """The cell or call that the lines recorded from now on belong to."""
    writer = process_writer(create=False)
    if writer is not None:
        writer.cell = label


def flush() -> None:
    """Spool what this process has gathered (before a query in this process, which converts
    the spool to Parquet first): on disk when this returns, whatever befalls this process."""
    writer = process_writer(create=False)
    if writer is not None:
        writer.flush()
