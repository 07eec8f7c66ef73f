"""The history's spool: a recorder puts its batches on disk itself, so its writer process may
convert them whenever the CPU is idle, or never: a query converts what is pending first, a
recorder killed (with its writer) before any conversion loses nothing spooled, and the spool
counts toward the host's size cap.  Real controller scripts and ranks; the writer process is
frozen (SIGSTOP), as a writer starved on a busy machine is."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest
from support.scripts import said, write_script

import monarch_kernel
from monarch_kernel.history import places

pytestmark = pytest.mark.timeout(120)

CONTROLLER = """
import sys, time
import monarch_kernel
from monarch_kernel import this_host
from monarch_kernel.history import recorder, writer_process
from monarch_kernel.runtime.process import Runtime
from support.actors import Talker


def spooled():
    return len(list((writer.root / ".spool").rglob("*.batch")))


def say(word, value):
    sys.stdout.write(f"{word} {value}\\n")
    sys.stdout.flush()


name, mode, rounds, per_round = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "cap":  # the writer never catches up, and no other starts: the recorder alone keeps the cap
    writer_process.spool_bound = lambda max_bytes: 1 << 40
seen = []
Runtime.current().hooks.record.install(  # lines and metrics (control lines) come on streams of their own
    lambda mesh, rank, stream, lines: seen.append(lines.count(b"metric ") if stream == "control"
                                                  else lines.count(b" says ")))
procs = this_host().spawn_procs(per_host={"gpus": 2}, name=name)
writer = recorder.process_writer(create=False)
writer.sink.start()  # now, for the test to freeze it (a spawn alone starts none: nothing to convert yet)
say("WRITER", writer.sink.pid)
sys.stdin.readline()  # the test has frozen it
talker = procs.spawn("talker", Talker)
for i in range(rounds):
    talker.talk.call(per_round).get(timeout=60)
    deadline = time.monotonic() + 60
    while sum(seen) < 4 * per_round * (i + 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    monarch_kernel.history.flush()  # on disk: spooled, not converted
say("SPOOLED", spooled())
if mode == "query":
    got = monarch_kernel.history(name).sql("SELECT count(*) AS n FROM lines")
    say("LINES", int(got["n"][0]))
    say("PENDING", spooled())
    sys.exit(0)
time.sleep(600)
"""


@contextlib.contextmanager
def controller(tmp_path, name: str, mode: str, rounds: int, per_round: int, **env):
    """The controller script; it and its writer process are killed if the test leaves them."""
    env = {**os.environ, "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "hist"), "MONARCH_KERNEL_HISTORY_FLUSH": "60",
           **env}
    writers: list[int] = []
    with subprocess.Popen([sys.executable, write_script(tmp_path, "controller.py", CONTROLLER), name, mode,
                           str(rounds), str(per_round)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            yield proc, writers
        finally:
            for pid in [proc.pid, *writers]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)


def freeze_writer(proc: subprocess.Popen, writers: list[int]) -> int:
    """Stop the controller's writer process (it converts nothing from now on), then let the
    controller go on; its pid."""
    pid = int(said(proc, "WRITER"))
    writers.append(pid)
    os.kill(pid, signal.SIGSTOP)
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return pid


def spooled(root) -> list[str]:
    folder = root / ".spool"
    return sorted(p.name for p in folder.rglob("*.batch")) if folder.exists() else []


def test_a_recorder_killed_with_its_writer_before_any_conversion_loses_no_spooled_line(tmp_path):
    root = tmp_path / "hist"
    with controller(tmp_path, "sp-kill", "kill", 3, 100) as (proc, writers):
        writer = freeze_writer(proc, writers)
        assert int(said(proc, "SPOOLED")) >= 3  # one batch per flush, none converted
        assert not list(root.glob("sp-kill/*/*/*.parquet"))
        for pid in (proc.pid, writer):  # the whole job ends at once (the OOM killer, a Slurm job's end)
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(writer).wait(timeout=30)
    h = monarch_kernel.history("sp-kill", root=root)  # a new process: it converts what is spooled first
    got = h.sql("SELECT rank, count(*) AS n, count(DISTINCT line) AS d FROM lines GROUP BY rank ORDER BY rank")
    assert got.to_dict("list") == {"rank": [0, 1], "n": [300, 300], "d": [100, 100]}
    assert int(h.sql("SELECT count(*) AS n FROM metrics")["n"][0]) == 600
    assert spooled(root) == []
    assert h.sql("SELECT count(*) AS n FROM lines")["n"][0] == 600  # converted once: a second query adds nothing


def test_a_query_converts_what_is_spooled_first_though_the_writer_is_frozen(tmp_path):
    with controller(tmp_path, "sp-query", "query", 2, 50) as (proc, writers):
        freeze_writer(proc, writers)
        assert int(said(proc, "SPOOLED")) >= 2
        assert said(proc, "LINES") == "200"  # 2 ranks x 2 rounds x 50 lines: the query converted them
        assert said(proc, "PENDING") == "0"
        assert proc.wait(timeout=60) == 0


def test_the_spool_counts_toward_the_size_cap_while_nothing_converts_it(tmp_path):
    root = tmp_path / "hist"
    cap = 1 << 20
    # 8 rounds of 2 ranks x 6,000 lines of metrics and lines: about 3 MiB spooled, 3 times the cap
    with controller(tmp_path, "sp-cap", "cap", 8, 6000, MONARCH_KERNEL_HISTORY_MAX_BYTES=str(cap)) as (proc, writers):
        freeze_writer(proc, writers)
        said(proc, "SPOOLED")
        on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name.endswith((".batch",
                                                                                                     ".parquet")))
        assert on_disk <= cap, f"{on_disk:,} bytes spooled past the cap of {cap:,}"
        assert not list(root.glob("sp-cap/*/*/*.parquet"))  # nothing converted: the spool alone was trimmed
        # Listed all the same, from the batches dropped (a converter behind the cap may list it only
        # once the ranks fall silent: a query meanwhile found "no history named ...").
        metas = [places.read_meta(f.parent) for f in root.glob("sp-cap/*/*/meta.json")]
        assert [(m["name"], m["state"], m["ranks"]) for m in metas] == [("sp-cap", "running", 2)], metas
    h = monarch_kernel.history("sp-cap", root=root)
    dropped = h.sql("SELECT detail FROM events WHERE kind = 'history_dropped'")
    assert len(dropped) >= 1 and "history_max_bytes" in dropped["detail"][0]
    n = int(h.sql("SELECT count(*) AS n FROM lines WHERE rank = 0")["n"][0])
    assert 6000 <= n < 8 * 6000, n  # the oldest rounds went, the newest is whole
