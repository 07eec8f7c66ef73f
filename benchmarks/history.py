"""The history's cost and its query figure (issue 45), beside W7.

- ``history_cell``: W7's ``%%mesh`` cell (``x = 1``, and one printing 100 lines) on 4 ranks
  through two real kernels, one with the history off (``MONARCH_KERNEL_HISTORY=0``) and one
  with it on, cells alternating between them; ms, median of 40 each, and the difference in %.
- ``history_lines``: 4 ranks printing as fast as they can through the real output path into
  this controller; lines/s and the controller's CPU per line with the history recording and
  without (its hook removed), runs alternating; % slower.
- ``history_paced``: the issue's target: 4 ranks computing and printing about 100,000 lines/s
  between them (calibrated with the history off); how much longer their work takes with the
  history on, runs alternating; % slower.  A run ends once its lines are spooled; the
  spool's conversion to Parquet, which the writer does when the CPU is idle, is then waited
  for, its CPU reported apart (``deferred``) and beside the work's.
- ``history_query``: RANKS ranks print LINES lines each and METRICS metric points each
  (``monarch_kernel.metric``) through the ranks' print path into a fresh history, then grouped
  queries over it, timed from opening the history (DuckDB over the Parquet files) to the
  DataFrame; s, median of 5.  ``HISTORY_BENCH_SCALE`` (default 1: 100 ranks x 40,000 lines +
  3,600 metrics = 4M lines and 360,000 points, the issue's 1,000 ranks x 1 h in rows) scales
  the lines and metrics per rank down for CI; ``HISTORY_BENCH_RANKS`` sets the ranks (1,000:
  the issue's shape, if the machine holds them).
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

from monarch_kernel import Actor, endpoint

from ._util import log


class Printer(Actor):
    @endpoint
    def lines(self, n: int, metrics: int) -> int:
        """``n`` lines like a training loop's, and ``metrics`` points of ``loss`` among them."""
        import monarch_kernel as mk

        r = mk.current_rank().rank
        every = max(1, n // metrics) if metrics else 0
        m = 0
        for i in range(n):
            print(f"rank {r} step {i} loss {1.0 / (i + 1):.5f} tokens/s {1000 + i % 97}")
            if every and i % every == 0 and m < metrics:
                mk.metric("loss", 1.0 / (i + 1), step=m)
                m += 1
        while m < metrics:
            mk.metric("loss", 0.0, step=m)
            m += 1
        sys.stdout.flush()
        return n

    @endpoint
    def paced(self, n: int, spin: int) -> float:
        """``n`` steps of ``spin`` loop turns of pure-Python work, each printing a line; the
        seconds they took (the work is what the history's CPU would slow)."""
        r = current_rank_number()
        t = time.perf_counter()
        for i in range(n):
            x = 0
            for j in range(spin):
                x += j
            print(f"rank {r} step {i} loss {1.0 / (i + 1):.5f} acc {x % 97}")
        sys.stdout.flush()
        return time.perf_counter() - t


def _scratch() -> str:
    """A history folder of this job's own, removed when the job's process exits (each job
    runs in a process of its own: ``python -m benchmarks._run``)."""
    root = tempfile.mkdtemp(prefix="mk-bench-history-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _history_dir() -> str:
    """``MONARCH_KERNEL_HISTORY_DIR`` if set (kept), else a scratch folder."""
    if not os.environ.get("MONARCH_KERNEL_HISTORY_DIR"):
        os.environ["MONARCH_KERNEL_HISTORY_DIR"] = _scratch()
    return os.environ["MONARCH_KERNEL_HISTORY_DIR"]


def current_rank_number() -> int:
    import monarch_kernel as mk

    return mk.current_rank().rank


def _cell(kc, code: str, timeout: float = 120) -> float:
    t = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            break
    reply = kc.get_shell_msg(timeout=timeout)["content"]
    assert reply["status"] == "ok", reply
    return time.perf_counter() - t


def cell_cost() -> dict:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import start_new_kernel

    from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    root = _scratch()
    kernels = {}
    try:
        for state in ("off", "on"):
            env = {**os.environ, "MONARCH_KERNEL_HISTORY": "1" if state == "on" else "0",
                   "MONARCH_KERNEL_HISTORY_DIR": root}
            kernels[state] = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=60, env=env)
            _cell(kernels[state][1], "procs = %mesh spawn -n 4")
        out: dict = {}
        for name, code in (("x1", "%%mesh\nx = 1"), ("print100", "%%mesh\nfor i in range(100): print(i)")):
            times: dict[str, list[float]] = {"off": [], "on": []}
            for i in range(50):
                for state in ("off", "on") if i % 2 else ("on", "off"):
                    t = _cell(kernels[state][1], code)
                    if i >= 10:
                        times[state].append(t)
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            out[name] = {"off_ms": round(off * 1e3, 2), "on_ms": round(on * 1e3, 2),
                         "slower_pct": round(100 * (on - off) / off, 1)}
    finally:
        for km, kc in kernels.values():
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    result = {"W7_history_cell": out}
    log(f"history cell: {result}")
    return result


def lines_cost() -> dict:
    from monarch_kernel import history, this_host
    from monarch_kernel.runtime import Runtime

    _history_dir()
    n_ranks, per_rank = 4, int(os.environ.get("HISTORY_BENCH_LINES_PER_RANK", "100000"))
    seen = [0]

    def count(mesh, rank, stream, line):
        seen[0] += 1

    rt = Runtime.current()
    rt.hooks.output.install(count)
    procs = this_host().spawn_procs(per_host={"ranks": n_ranks}, name="bench-lines")
    recorder = history.record_history(rt)
    assert recorder is not None, "the history is off (MONARCH_KERNEL_HISTORY=0): nothing to compare"
    printers = procs.spawn("p", Printer)
    printers.lines.call(1000, 0).get(timeout=60)  # warm
    results: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    deferred: list[float] = []
    hook = recorder.record
    for i in range(6):
        state = ("on", "off")[i % 2]
        handle = rt.hooks.record.install(hook) if state == "on" and not rt.hooks.record.has(hook) else None
        if state == "off":
            for h in recorder.handles:
                h.remove()
        target = seen[0] + n_ranks * per_rank
        cpu0, t0 = time.process_time(), time.perf_counter()
        printers.lines.call(per_rank, 0).get(timeout=300)
        deadline = time.monotonic() + 120
        while seen[0] < target and time.monotonic() < deadline:
            time.sleep(0.001)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        results[state].append((n_ranks * per_rank / wall, cpu / (n_ranks * per_rank) * 1e6))
        if handle is not None:
            handle.remove()
        if state == "on":  # its spool converted before the next run, counted apart
            history.flush()
            deferred.append(_converted(recorder.writer.root, recorder.writer.sink.pid))  # type: ignore[attr-defined]
    procs.stop().get(timeout=60)
    off_rate = statistics.median(r for r, _c in results["off"])
    on_rate = statistics.median(r for r, _c in results["on"])
    off_cpu = statistics.median(c for _r, c in results["off"])
    on_cpu = statistics.median(c for _r, c in results["on"])
    result = {"history_lines": {"ranks": n_ranks, "lines_per_run": n_ranks * per_rank,
                                "off_lines_per_s": round(off_rate), "on_lines_per_s": round(on_rate),
                                "slower_pct": round(100 * (off_rate - on_rate) / off_rate, 1),
                                "controller_cpu_us_per_line_off": round(off_cpu, 2),
                                "controller_cpu_us_per_line_on": round(on_cpu, 2),
                                "deferred_cpu_us_per_line": round(statistics.median(deferred)
                                                                  / (n_ranks * per_rank) * 1e6, 2)}}
    log(f"history lines: {result}")
    return result


def paced_cost() -> dict:
    """4 ranks computing on this host's cores, printing at about 100,000 lines a second between
    them (the issue's rate, calibrated with the history off): how much longer their work takes
    with the history recording, runs alternating.  A run with the history on ends once its
    lines are spooled (``history.flush()``); the writer's CPU while it runs is counted, and
    the spool's conversion after it is waited for and counted apart, so no run pays for another's."""
    from monarch_kernel import history, this_host
    from monarch_kernel.runtime import Runtime

    _history_dir()
    n_ranks, rate, seconds = 4, 100_000, 3.0
    rt = Runtime.current()
    rt.hooks.output.install(lambda *a: None)
    procs = this_host().spawn_procs(per_host={"ranks": n_ranks}, name="bench-paced")
    recorder = history.record_history(rt)
    assert recorder is not None, "the history is off (MONARCH_KERNEL_HISTORY=0): nothing to compare"
    printers = procs.spawn("p", Printer)
    hook = recorder.record
    for h in recorder.handles:
        h.remove()
    spin, per_rank = 500, int(rate * seconds / n_ranks)
    for _ in range(3):  # calibrate, history off: the spin that gives the rate
        took = max(printers.paced.call(per_rank // 4, spin).get(timeout=300).values())
        spin = max(1, int(spin * (per_rank // 4) / rate * n_ranks / took))
    ranks = [s["pid"] for s in procs.rank_states()]
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}  # the ranks', controller's, writer's
    deferred: list[float] = []  # the CPU of the conversion after each run with the history on
    for i in range(12):
        state = ("on", "off")[i % 2]
        handle = rt.hooks.record.install(hook) if state == "on" else None
        writer = recorder.writer.sink.pid if state == "on" else None  # type: ignore[attr-defined]
        before = (sum(_cpu(p) for p in ranks), time.process_time(), _cpu(writer))
        t = time.perf_counter()
        printers.paced.call(per_rank, spin).get(timeout=300)
        if handle is not None:
            handle.remove()
            history.flush()  # counted: until every line of the run is spooled (on disk)
        times[state].append(time.perf_counter() - t)
        writer = writer if writer == recorder.writer.sink.pid else None  # type: ignore[attr-defined]
        cpu[state].append((sum(_cpu(p) for p in ranks) - before[0], time.process_time() - before[1],
                           _cpu(writer) - before[2] if writer else 0.0))
        if state == "on":  # the spool converted now, the ranks idle: its CPU counted apart, no run pays it
            deferred.append(_converted(recorder.writer.root, writer))
    procs.stop().get(timeout=60)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ranks_cpu = statistics.median(c[0] for c in cpu["off"])
    ctrl_off, ctrl_on = (statistics.median(c[1] for c in cpu[s]) for s in ("off", "on"))
    writer_cpu = statistics.median(c[2] for c in cpu["on"])
    lines = n_ranks * per_rank
    result = {"history_paced": {"ranks": n_ranks, "lines_per_run": n_ranks * per_rank, "spin": spin,
                                "off_lines_per_s": round(n_ranks * per_rank / off),
                                "on_lines_per_s": round(n_ranks * per_rank / on),
                                "off_s": [round(t, 3) for t in times["off"]],
                                "on_s": [round(t, 3) for t in times["on"]],
                                "slower_pct": round(100 * (on - off) / off, 1),
                                # the CPU the history takes (the controller's more, and the writer's) beside
                                # the CPU of the work it slows: the slowdown once every core is busy
                                "controller_cpu_us_per_line_more": round((ctrl_on - ctrl_off) / lines * 1e6, 2),
                                "writer_cpu_us_per_line": round(writer_cpu / lines * 1e6, 2),
                                "history_cpu_pct_of_work": round(100 * (ctrl_on - ctrl_off + writer_cpu)
                                                                 / (ranks_cpu + ctrl_off), 1),
                                # the spool's conversion to Parquet, deferred to when the CPU is idle
                                "deferred_cpu_us_per_line": round(statistics.median(deferred) / lines * 1e6, 2),
                                "history_cpu_pct_of_work_with_deferred": round(
                                    100 * (ctrl_on - ctrl_off + writer_cpu + statistics.median(deferred))
                                    / (ranks_cpu + ctrl_off), 1)}}
    log(f"history paced: {result}")
    return result


def _converted(root, writer: int | None, timeout: float = 60.0) -> float:
    """Wait for the writer process to convert the spool under ``root`` (the ranks are idle
    now), converting here what is left after ``timeout``; the CPU seconds that took."""
    from monarch_kernel.history import convert, spool_files

    t0, w0 = time.process_time(), _cpu(writer)
    deadline = time.monotonic() + timeout
    while spool_files.pending(root) and time.monotonic() < deadline:
        time.sleep(0.02)
    convert.convert(root)
    return time.process_time() - t0 + (_cpu(writer) - w0 if writer else 0.0)


def _cpu(pid: int | None) -> float:
    """CPU seconds (user and system) of process ``pid`` so far; 0 for None or one gone."""
    from monarch_kernel.runtime import proc_stats

    got = proc_stats.usage(pid)
    return got[0] / os.sysconf("SC_CLK_TCK") if got is not None else 0.0


def query() -> dict:
    from monarch_kernel import history, this_host
    from monarch_kernel.runtime import Runtime, config

    scale = float(os.environ.get("HISTORY_BENCH_SCALE", "1"))
    ranks = int(os.environ.get("HISTORY_BENCH_RANKS", "100"))
    lines = int(40_000 * 100 / ranks * scale)
    metrics = int(3_600 * 100 / ranks * scale)
    root = _scratch()
    config.set("history_dir", root)
    Runtime.current().hooks.output.install(lambda *a: None)  # the lines are the history's, not the terminal's
    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"ranks": ranks}, name="bench-query")
    printers = procs.spawn("p", Printer)
    printers.lines.call(lines, metrics).get(timeout=3600)
    h = history("bench-query")
    total = ranks * lines
    deadline = time.monotonic() + 600
    while True:  # every line written (the writer's batches land in the next interval)
        history.flush()
        got = int(h.sql("SELECT count(*) AS n FROM lines")["n"][0])
        if got >= total or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    write_s = time.perf_counter() - t0
    procs.stop().get(timeout=120)
    history.flush()
    files = list(h.folder.glob("*/*.parquet"))
    queries = {
        "lines_by_rank": "SELECT rank, count(*) AS n, max(length(line)) AS longest FROM lines GROUP BY rank",
        "metrics_by_rank": "SELECT rank, min(value) AS best, max(step) AS last FROM metrics "
                           "WHERE name = 'loss' GROUP BY rank",
        "lines_matching": "SELECT rank, count(*) AS n FROM lines WHERE line LIKE '%step 39%' GROUP BY rank "
                          "ORDER BY n DESC LIMIT 10",
    }
    out: dict = {"ranks": ranks, "lines": got, "metric_points": int(h.sql("SELECT count(*) AS n FROM metrics")["n"][0]),
                 "files": len(files), "mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                 "write_s": round(write_s, 1)}
    for name, q in queries.items():
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            history(h.name, root=root).sql(q)
            samples.append(time.perf_counter() - t)
        out[f"{name}_s"] = round(statistics.median(samples), 3)
    result = {"history_query": out}
    log(f"history query: {result}")
    return result
