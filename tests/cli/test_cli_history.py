"""``monarch-kernel logs``, ``history`` and the finished runs of ``ls``: a script's mesh prints
through the real path and ends (its process, and so its "allocation", gone), then the command
line, in its own subprocess with no kernel, reads what it printed from the history: by rank,
since a time, as JSON, in SQL; and ``logs --follow`` prints a running mesh's lines as they
come and returns when the mesh ends."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from support.cli import cli, command

pytestmark = pytest.mark.timeout(180)

TRAIN = '''
import os, sys, time
from monarch_kernel import Actor, endpoint, this_host, metric

class Trainer(Actor):
    @endpoint
    def go(self, n, pause, until=None):
        for i in range(n):
            print(f"step {i}", flush=True)
            metric("loss", 1.0 / (i + 1), step=i)
            time.sleep(pause)
            if until and os.path.exists(until):
                break
        print("done", file=sys.stderr, flush=True)

procs = this_host().spawn_procs(per_host={"gpus": 2}, name=sys.argv[1])
print("up", flush=True)
procs.spawn("t", Trainer).go.call(int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:]).get(timeout=150)
procs.stop().get(timeout=30)
'''


@pytest.fixture
def env(tmp_path) -> dict:
    return {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
            "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "history")}


def train(tmp_path, env: dict, name: str, steps: int, pause: float, *until: str) -> subprocess.Popen:
    """The script, its ranks printing ``steps`` steps ``pause`` s apart (or until the file
    ``until`` exists)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.Popen([sys.executable, str(script), name, str(steps), str(pause), *until], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_a_finished_runs_lines_and_metrics_are_read_after_it_ended(tmp_path, env):
    run = train(tmp_path, env, "train", 3, 0)
    assert run.wait(120) == 0
    run.stdout.close()
    code, out, err = cli("ls", "--json", env=env)
    assert code == 0, err
    (row,) = json.loads(out)
    assert (row["name"], row["kind"], row["state"], row["ranks"]) == ("train", "finished", "ended", 2), row

    code, out, err = cli("logs", "train", env=env)
    assert code == 0, err
    for r in (0, 1):  # in the order printed: each rank's in its own order, the ranks' interleaved by time
        assert [x for x in out.splitlines() if x.startswith(f"[rank {r}]")] == [
            *(f"[rank {r}] step {i}" for i in range(3)), f"[rank {r}] (stderr) done"], out
    assert len(out.splitlines()) == 8, out
    code, out, err = cli("logs", "train", "--rank", "1", "--since", "10m", "--json", env=env)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(x["rank"], x["stream"], x["line"]) for x in lines] == [
        (1, "stdout", "step 0"), (1, "stdout", "step 1"), (1, "stdout", "step 2"), (1, "stderr", "done")]
    assert cli("logs", "train", "--since", "2030-01-01T00:00:00", env=env)[:2] == (0, "")
    assert cli("logs", "train", "--since", "soon", env=env)[0] == 2

    code, out, err = cli("history", "train", "SELECT rank, count(*) AS n FROM lines GROUP BY rank ORDER BY rank",
                         env=env)
    assert code == 0, err
    assert [line.split() for line in out.splitlines()] == [["rank", "n"], ["0", "4"], ["1", "4"]]
    code, out, err = cli("history", "train", "SELECT rank, max(step) AS last FROM metrics WHERE name = 'loss' "
                         "GROUP BY rank ORDER BY rank", "--json", env=env)
    assert code == 0 and json.loads(out) == [{"rank": 0, "last": 2}, {"rank": 1, "last": 2}], (out, err)
    code, out, err = cli("history", "train", "SELEC nothing", env=env)
    assert code == 1 and err.startswith("monarch-kernel: the query failed: Parser Error"), err
    code, out, err = cli("logs", "nope", env=env)
    assert code == 3 and "no history named 'nope'" in err and "monarch-kernel ls lists them" in err, err


def test_logs_follow_prints_lines_as_they_come_and_ends_with_the_mesh(tmp_path, env):
    env = {**env, "MONARCH_KERNEL_HISTORY_FLUSH": "0.2"}  # the history's batches: lines reach the files sooner
    stop = tmp_path / "stop"  # the run goes on until the test has seen a line followed (a loaded machine is slow)
    run = train(tmp_path, env, "slow", 300, 0.4, str(stop))
    try:
        assert run.stdout.readline().strip() == "up"
        # the run's history exists once its first batch is written (its writer process may still be starting)
        deadline = time.monotonic() + 60
        while "slow" not in {r["name"] for r in json.loads(cli("ls", "--json", env=env)[1] or "[]")}:
            assert time.monotonic() < deadline, "the run's history was not listed within 60 s"
            time.sleep(0.1)
        follow = subprocess.Popen(command("logs", "slow", "--rank", "0", "--follow"),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout], daemon=True)
        reader.start()
        try:
            first = lines.get(timeout=60)  # while the run goes on: it ends only once told to below
            assert first.strip().startswith("[rank 0] step"), first
            assert run.poll() is None, "the run ended by itself"
            stop.touch()
            assert follow.wait(60) == 0, follow.stderr.read()  # it returns by itself once the mesh has ended
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait(10)
            reader.join(30)  # every line it printed is in the queue
            follow.stdout.close()
            follow.stderr.close()
        got = [first.strip()]
        while not lines.empty():
            got.append(lines.get_nowait().strip())
        steps = len(got) - 1
        assert steps >= 1 and got == [f"[rank 0] step {i}" for i in range(steps)] + ["[rank 0] (stderr) done"], got
    finally:
        stop.touch()
        assert run.wait(120) == 0
        run.stdout.close()


def test_each_run_of_a_name_is_listed_and_read_apart(tmp_path, env):
    for steps in (3, 2):  # the same script run twice: two runs of "again"
        run = train(tmp_path, env, "again", steps, 0)
        assert run.wait(120) == 0
        run.stdout.close()
    code, out, err = cli("ls", "--json", env=env)
    assert code == 0, err
    rows = [r for r in json.loads(out) if r["name"] == "again"]
    assert [(r["kind"], r["state"]) for r in rows] == [("finished", "ended")] * 2, rows
    new, old = rows[0]["run"], rows[1]["run"]  # the latest first
    assert old < new, rows
    code, out, err = cli("ls", env=env)
    assert code == 0 and out.splitlines()[0].split()[-1] == "RUN" and new in out and old in out, out

    # the latest run by default; --run another; --run all both, with their runs
    query = "SELECT rank, count(*) AS n FROM lines WHERE stream = 'stdout' GROUP BY rank ORDER BY rank"
    code, out, err = cli("history", "again", query, "--json", env=env)
    assert code == 0 and json.loads(out) == [{"rank": 0, "n": 2}, {"rank": 1, "n": 2}], (out, err)
    code, out, err = cli("history", "again", query, "--run", old, "--json", env=env)
    assert code == 0 and json.loads(out) == [{"rank": 0, "n": 3}, {"rank": 1, "n": 3}], (out, err)
    code, out, err = cli("history", "again", "SELECT run, max(step) AS last FROM metrics GROUP BY run ORDER BY run",
                         "--run", "all", "--json", env=env)
    assert code == 0 and json.loads(out) == [{"run": old, "last": 2}, {"run": new, "last": 1}], (out, err)
    code, out, err = cli("logs", "again", "--rank", "0", "--run", old, env=env)
    assert code == 0 and out.splitlines() == ["[rank 0] step 0", "[rank 0] step 1", "[rank 0] step 2",
                                              "[rank 0] (stderr) done"], (out, err)
    code, out, err = cli("history", "again", "SELECT 1", "--run", "nope", env=env)
    assert code == 3 and f"its runs, newest first: {new}, {old}" in err, err
