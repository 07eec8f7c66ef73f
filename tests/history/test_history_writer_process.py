"""A controller records its history without loading pyarrow, numpy or pandas: its batches go
to a writer process of its own (``writer_process``), which writes the Parquet files, outlives
its controller only to write what it was given, and never outlives it otherwise.  Real
controller scripts, real ranks printing, the files asked in SQL."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest
from support.config import configured
from support.scripts import said, write_script

import monarch_kernel

pytestmark = pytest.mark.timeout(120)

CONTROLLER = """
import json, sys, time
HEAVY = ("pyarrow", "pandas", "numpy", "duckdb")

import monarch_kernel
from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.history import recorder
from monarch_kernel.runtime.process import Runtime


class Talker(Actor):
    @endpoint
    def talk(self, word: str, n: int) -> int:
        import monarch_kernel as mk

        r = mk.current_rank().rank
        for i in range(n):
            print(f"rank {r} {word} {i}")
            mk.metric("loss", float(i), step=i)
        return r




def say(word, value):  # one write: the ranks' lines, printed by other threads, never split it
    sys.stdout.write(f"{word} {value}\\n")
    sys.stdout.flush()


name, mode = sys.argv[1], sys.argv[2]
procs = this_host().spawn_procs(per_host={"gpus": 2}, name=name)
talker = procs.spawn("talker", Talker)
if mode == "quiet":  # calls that print nothing: what is recorded waits on disk, converted by no process
    talker.talk.call("says", 0).get(timeout=60)
    writer = recorder.process_writer(create=False)
    monarch_kernel.history.flush()  # the spawn's event and the run's info: spooled when this returns
    say("WRITER", writer.sink.pid)
    got = monarch_kernel.history(name).sql("SELECT kind FROM events")  # converted by the query itself
    say("EVENTS", json.dumps(sorted(got["kind"])))
    seen = []  # the lines as the controller records them (they may come after the call's answer)
    Runtime.current().hooks.record.install(lambda mesh, rank, stream, lines: seen.append(lines.count(b" says ")))
    talker.talk.call("says", 5).get(timeout=60)
    deadline = time.monotonic() + 60
    while (writer.sink.pid is None or sum(seen) < 10) and time.monotonic() < deadline:  # the first lines start it
        time.sleep(0.05)
    say("WRITER", writer.sink.pid)
    sys.exit(0)
talker.talk.call("says", 50).get(timeout=60)
if mode == "flush":
    monarch_kernel.history.flush()  # every row so far written: waits for the writer process
    say("HEAVY", json.dumps([m for m in HEAVY if m in sys.modules]))
    got = monarch_kernel.history(name).sql("SELECT count(*) AS n FROM lines")
    say("LINES", int(got["n"][0]))
    sys.exit(0)
writer = recorder.process_writer(create=False)
deadline = time.monotonic() + 60
while writer.sink.pid is None and time.monotonic() < deadline:  # the first batch starts it
    time.sleep(0.05)
say("WRITER", writer.sink.pid)
seen = []  # the last call's lines, as the controller records them (they may come after its answer)
Runtime.current().hooks.record.install(lambda mesh, rank, stream, lines: seen.append(lines.count(b" last ")))
talker.talk.call("last", 20).get(timeout=60)
while sum(seen) < 40 and time.monotonic() < deadline + 60:
    time.sleep(0.05)
if mode == "kill":
    monarch_kernel.history.flush()  # what was recorded is written; the rest was never handed over
    say("READY", "now")
    time.sleep(600)
"""


def until(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.1)
    return got


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def controller(tmp_path, name: str, mode: str, flush_s: float):
    """The controller script, killed if the test leaves it running."""
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist"),
           "MONARCH_KERNEL_HISTORY_FLUSH": str(flush_s)}
    with subprocess.Popen([sys.executable, write_script(tmp_path, "controller.py", CONTROLLER), name, mode],
                          stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def count(tmp_path, name: str, where: str) -> int:
    try:
        h = monarch_kernel.history(name, root=tmp_path / "hist")
    except monarch_kernel.history.HistoryNotFound:  # not written yet
        return 0
    return int(h.sql(f"SELECT count(*) AS n FROM lines WHERE {where}")["n"][0])


def test_a_controller_records_without_loading_arrow_and_a_query_there_sees_every_line(tmp_path):
    with controller(tmp_path, "wp-flush", "flush", 60.0) as proc:  # nothing written but by the flush
        heavy = said(proc, "HEAVY")
        assert heavy == "[]", f"the controller loaded {heavy} to record its history"
        assert said(proc, "LINES") == "100"  # 2 ranks x 50 lines, all written before the query
        assert proc.wait(timeout=60) == 0
    root = tmp_path / "hist"
    for path in [root / "wp-flush", *(root / "wp-flush").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} is {mode:o}"
    until("the metrics", lambda: monarch_kernel.history("wp-flush", root=root).sql(
        "SELECT count(*) AS n FROM metrics")["n"][0] == 100)


def test_a_mesh_that_prints_nothing_starts_no_writer_process_and_is_still_queried(tmp_path):
    """A quiet mesh's spawn and events wait on disk (no process loading pyarrow beside its
    ranks' first calls); a query converts them itself, and the first lines start the writer."""
    with controller(tmp_path, "wp-quiet", "quiet", 0.1) as proc:
        assert said(proc, "WRITER") == "None"
        assert said(proc, "EVENTS") == '["spawn"]'
        writer = said(proc, "WRITER")
        assert writer != "None", "the first lines started no writer process"
        assert proc.wait(timeout=60) == 0
    until("the writer process to end with its controller", lambda: gone(int(writer)))
    assert count(tmp_path, "wp-quiet", "line LIKE 'rank % says %'") == 10


def test_a_controller_exits_without_waiting_and_its_writer_writes_the_rest_then_ends(tmp_path):
    with controller(tmp_path, "wp-exit", "exit", 0.1) as proc:
        writer = int(said(proc, "WRITER"))
        assert writer != proc.pid
        assert proc.wait(timeout=60) == 0
    # a query at once waits for the writer of a controller that is gone (``pending``)
    assert count(tmp_path, "wp-exit", "line LIKE 'rank % last %'") == 40  # printed just before the exit
    assert count(tmp_path, "wp-exit", "line LIKE 'rank % says %'") == 100
    until("the writer process to end with its controller", lambda: gone(writer))
    listed = {r.name: r for r in monarch_kernel.history.list_histories(root=tmp_path / "hist")}
    assert listed["wp-exit"].state == "ended"  # the controller's pid in its meta: not "gone", not "running"


def test_a_killed_controllers_writer_process_ends_too(tmp_path):
    with controller(tmp_path, "wp-kill", "kill", 0.1) as proc:
        writer = int(said(proc, "WRITER"))
        said(proc, "READY")
        assert not gone(writer)
        # it holds none of its controller's output: a reader of that to its end never waits for it
        assert os.readlink(f"/proc/{writer}/fd/2") == str(tmp_path / "hist" / "writer.log")
        assert stat.S_IMODE(os.stat(tmp_path / "hist" / "writer.log").st_mode) == 0o600
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        until("the writer process to end with its killed controller", lambda: gone(writer), timeout=30)
    assert count(tmp_path, "wp-kill", "line LIKE 'rank % last %'") == 40  # flushed before the kill: written


def test_a_writer_whose_controller_is_gone_before_its_first_word_ends_at_once(tmp_path):
    """A controller that exits (``os._exit``, strict mode) between starting its writer and
    handing it its marker: the writer reads the end of its pipe first, and ends."""
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist")}
    with subprocess.Popen([sys.executable, "-m", "monarch_kernel.history.writer_process"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env) as writer:
        assert writer.stdin is not None
        writer.stdin.close()
        try:
            assert writer.wait(timeout=60) == 0
        finally:
            if writer.poll() is None:
                writer.kill()


def test_the_writer_process_and_its_session_run_at_idle_priority(tmp_path):
    """It converts only with the CPU the ranks leave.  Its session is its own (a signal to the
    controller's group must not end it), and where Linux schedules each session as a group
    (autogroup), a nice process alone in one still took a third of a 2-core machine beside
    a controller and its ranks: the group is niced too."""
    from monarch_kernel.history.writer_process import NICE, WriterProcess

    with configured(history_dir=str(tmp_path / "hist")):
        writer = WriterProcess()
        writer.start()
        pid = writer.pid
        assert pid is not None
        try:
            assert os.getpriority(os.PRIO_PROCESS, pid) == NICE
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
            if os.path.exists(f"/proc/{pid}/autogroup"):
                with open(f"/proc/{pid}/autogroup") as f:
                    assert f.read().split()[-1] == str(NICE), "its session's group is not niced"
        finally:
            writer.close()
        until("the writer process to end once let go", lambda: gone(pid))
        writer.write(None, wait=False)  # which reaps it
