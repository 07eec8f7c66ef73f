"""The ``monarch-kernel`` command line, run as a user runs it: the installed console script
in a subprocess (``python -m monarch_kernel`` is the same click group), with no kernel running.
A real detached mesh is listed, its stacks and load read, and stopped from the command line; a
running kernel's mesh is listed and stopped through that kernel; ``attach`` opens ``jupyter
console`` on a detached mesh; exit codes are 0 ok, 1 failed, 2 bad usage, 3 not found, and
``--json`` is one JSON document."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import tomllib
from support.cli import cli, command
from support.detached import end, start_detached_host
from support.kernels import assert_gone, run, text

from monarch_kernel.kernel import magic_args

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path) -> dict:
    """An environment whose runtime directory (records) and histories are this test's alone."""
    return {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
            "MONARCH_KERNEL_HISTORY_DIR": str(tmp_path / "history")}


def test_pyproject_declares_the_console_script():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"monarch-kernel": "monarch_kernel.cli:main"}
    assert any(d.startswith("click") for d in project["dependencies"])
    from monarch_kernel.cli import main

    assert set(main.commands) >= {"ls", "stop", "kill-job", "stacks", "top", "attach", "install", "settings", "key"}
    # the installed script and python -m are the same group, each naming itself in its help
    script = cli("--help")
    module = subprocess.run([sys.executable, "-m", "monarch_kernel", "--help"], capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert script[0] == module.returncode == 0, (script, module.stderr)
    assert script[1].startswith("Usage: monarch-kernel [OPTIONS] COMMAND"), script[1]
    assert module.stdout == script[1].replace("monarch-kernel [OPTIONS]", "python -m monarch_kernel [OPTIONS]", 1)


def test_a_detached_mesh_is_listed_read_and_stopped_with_no_kernel(env, tmp_path):
    host = start_detached_host("dm", env, tmp_path / "host.log", ranks=2)
    try:
        code, out, err = cli("ls", env=env)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["NAME", "KIND", "STATE", "RANKS", "HOSTS", "OWNER", "ATTACHED", "RUN"]
        assert lines[1].split()[:4] == ["dm", "detached", "running", "2"] and f"host pid {host.pid}" in lines[1]
        code, out, err = cli("ls", "--json", env=env)
        assert code == 0, err
        (row,) = json.loads(out)  # its history's run is its own row's, not a finished one
        assert (row["name"], row["kind"], row["state"], row["ranks"], row["owner"]) == (
            "dm", "detached", "running", 2, f"host pid {host.pid}")
        assert row["run"] and row["run"] in lines[1].split(), (row, lines)

        code, out, err = cli("stacks", "dm", env=env)
        assert code == 0, err
        assert out.startswith("Stacks of mesh 'dm': 2 ranks in 1 group\n  taken by in-process: ranks 0-1\n"), out
        code, out, err = cli("stacks", "dm", "1", "--all-threads", "--json", env=env)
        assert code == 0, err
        got = json.loads(out)
        assert got["mesh"] == "dm" and [s["rank"] for s in got["ranks"]] == [1]
        assert got["ranks"][0]["threads"] and got["ranks"][0]["method"] == "in-process", got

        code, out, err = cli("top", "dm", "--count", "2", "--interval", "0.2", "--json", env=env)
        assert code == 0, err
        samples = [json.loads(line) for line in out.splitlines()]
        assert len(samples) == 2 and [r["rank"] for r in samples[1]["ranks"]] == [0, 1]
        pids = [r["pid"] for r in samples[1]["ranks"]]
        assert all(psutil.pid_exists(p) for p in pids) and all(r["rss_mib"] > 0 for r in samples[1]["ranks"])
        assert all(r["cpu"] is not None for r in samples[1]["ranks"])  # the second sample has a CPU %
        code, out, err = cli("top", "dm", "--count", "1", env=env)
        assert code == 0 and out.splitlines()[0].split()[:4] == ["rank", "host", "CPU", "%"], out

        code, out, err = cli("stop", "dm", env=env)
        assert (code, out.strip()) == (0, "stopped detached mesh 'dm': its 2 ranks and its host process ended"), err
        assert host.wait(30) is not None
        assert_gone(pids, 15, "the detached mesh's ranks outlived monarch-kernel stop")
        (row,) = json.loads(cli("ls", "--json", env=env)[1])  # only its history is left
        assert (row["name"], row["kind"], row["state"], row["ranks"]) == ("dm", "finished", "ended", 2), row
        code, out, err = cli("stop", "dm", "--json", env=env)
        assert code == 3 and json.loads(out)["exit_code"] == 3, (out, err)
        assert err.strip() == ("monarch-kernel: no mesh or job named 'dm' (there are: none); "
                               "monarch-kernel ls lists them")
    finally:
        end(host)


def test_stopping_on_a_terminal_draws_a_progress_bar(env, tmp_path):
    host = start_detached_host("dm", env, tmp_path / "host.log", ranks=4)
    main, side = pty.openpty()  # stderr is a terminal; stdout stays a pipe
    try:
        r = subprocess.run(command("stop", "dm"), stdout=subprocess.PIPE,
                           stderr=side, stdin=subprocess.DEVNULL, text=True, env=env, timeout=120)
        os.close(side)
        side = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal's other side closed: all is read
                break
            if not chunk:
                break
            drawn += chunk
        assert r.returncode == 0 and r.stdout.startswith("stopped detached mesh 'dm'"), r
        assert b"stopping dm" in drawn and b"4/4" in drawn, drawn
        assert host.wait(30) is not None
    finally:
        os.close(main)
        if side >= 0:
            os.close(side)
        end(host)
    code, out, err = cli("ls", "--json", env=env)
    assert code == 0 and "stopping" not in err  # piped: no bar


def test_exit_codes_say_bad_usage_and_not_found(env):
    assert cli("stop", env=env)[0] == 2  # no NAME
    assert cli("spwan", env=env)[0] == 2
    assert cli("top", "x", "--interval", "0", env=env)[0] == 2
    code, _out, err = cli("stacks", "nope", env=env)
    assert code == 3 and "no mesh or job named 'nope'" in err
    assert cli("kill-job", "nope", env=env)[0] == 3
    assert cli("attach", "nope", env=env)[0] == 3


def test_subcommands_that_mean_what_mesh_magics_mean_share_their_help(env):
    code, out, _err = cli("stacks", "--help", env=env)
    assert code == 0
    flat = " ".join(out.split())
    for dest in ("native", "all_threads", "runtime_frames", "py_spy"):
        action = next(a for a in magic_args.COMMANDS["stacks"].parser._actions if a.dest == dest)
        assert " ".join(str(action.help).split()) in flat, dest
    assert " ".join(magic_args.summary(magic_args.COMMANDS["stacks"]).split()) in flat
    code, out, _err = cli("kill-job", "--help", env=env)
    assert " ".join(magic_args.summary(magic_args.COMMANDS["kill-job"]).split()) in " ".join(out.split())


def test_a_running_kernels_mesh_is_listed_and_stopped_through_that_kernel(kc):
    # a name of its own: another test's kernel on the other worker may run a mesh named procs
    out, reply = run(kc, "cli_only = %mesh spawn -n 1\nprint(cli_only.rank_states()[0]['pid'])")
    assert reply["status"] == "ok", text(out)
    pid = int(text(out).strip().splitlines()[-1])
    code, out, err = cli("ls", "--json")
    assert code == 0, err
    rows = [r for r in json.loads(out) if r["name"] == "cli_only" and r["kind"] == "mesh"]
    assert len(rows) == 1 and rows[0]["state"] == "running" and rows[0]["ranks"] == 1, out
    code, out, err = cli("stacks", "cli_only")
    assert code == 1 and "only that kernel reaches it: run  %mesh stacks  there" in err, err
    code, out, err = cli("attach", "cli_only", "--simple-prompt", stdin="%mesh list\n")
    assert code == 0 and "* cli_only: 1 rank, running" in out, (out, err)  # a console on that very kernel
    assert run(kc, "cli_only.name")[1]["status"] == "ok"  # which runs on after the console
    code, out, err = cli("stop", "cli_only")
    assert (code, out.strip()) == (0, "stopped mesh cli_only: its 1 rank ended"), err
    assert_gone([pid], 15, "monarch-kernel stop left the kernel's rank running")
    deadline = time.monotonic() + 30
    while any(r["name"] == "cli_only" and r["kind"] == "mesh" for r in json.loads(cli("ls", "--json")[1])):
        assert time.monotonic() < deadline, "the kernel's record still lists the stopped mesh"
        time.sleep(0.2)


@contextlib.contextmanager
def _worker(key: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A worker (``agent --listen``) and the address it listens on; killed at the end if the
    test's job did not end it."""
    worker = subprocess.Popen([sys.executable, "-m", "monarch_kernel.agent", "--listen", "tcp://127.0.0.1:0",
                               "--key-file", key], stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stderr is not None
        line = worker.stderr.readline()
        while "listening on" not in line:
            assert line, "the worker exited before it listened"
            line = worker.stderr.readline()
        yield worker, line.split("listening on ")[1].split()[0]
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(10)
        if worker.stderr is not None:
            worker.stderr.close()


def test_a_running_kernels_job_is_listed_and_killed_through_that_kernel(kc, tmp_path):
    from monarch_kernel.agent.worker_key import new_key_file

    key = new_key_file(str(tmp_path / "worker.key"))
    with _worker(key) as (worker, address):
        out, reply = run(kc, f"procs = %mesh spawn --attach {address} --key-file {key} -n 1", timeout=120)
        assert reply["status"] == "ok", text(out)
        # what runs now (finished runs of another test's mesh named procs are listed too, as "finished")
        rows = {r["name"]: r for r in json.loads(cli("ls", "--json")[1]) if r["kind"] != "finished"}
        assert rows["attach0"]["kind"] == "attach job" and rows["attach0"]["state"] == "running", rows
        assert rows["attach0"]["meshes"] == ["procs"] and rows["procs"]["job"] == "attach0", rows
        code, out, err = cli("kill-job", "attach0")
        assert (code, out.strip()) == (0, "job attach0 killed with its meshes procs"), err
        assert worker.wait(30) == 0  # the job's end: the workers it attached exit
        assert text(run(kc, "%mesh list").outputs).startswith("no meshes")


def test_a_job_made_with_the_api_in_a_cell_is_the_kernels_too(kc, tmp_path):
    """``attach_to_workers`` in a cell: the kernel adopts the job after the cell, so ``ls`` lists
    it with the mesh spawned on it (and that mesh's run), and ``kill-job`` ends it."""
    from monarch_kernel.agent.worker_key import new_key_file

    key = new_key_file(str(tmp_path / "worker.key"))
    with _worker(key) as (worker, address):
        out, reply = run(kc, f"from monarch_kernel.job import attach_to_workers\n"
                             f"hosts = attach_to_workers(workers=[{address!r}], key={key!r})\n"
                             f"api_procs = hosts.spawn_procs(per_host={{'ranks': 1}}, name='api_procs')", timeout=120)
        assert reply["status"] == "ok", text(out)
        rows = [r for r in json.loads(cli("ls", "--json")[1]) if r["kind"] != "finished"]
        jobs = [r for r in rows if r["kind"] == "attach job"]
        mesh = next(r for r in rows if r["name"] == "api_procs")
        assert len(jobs) == 1 and jobs[0]["meshes"] == ["api_procs"] and mesh["job"] == jobs[0]["name"], rows
        assert jobs[0]["name"] == "cell-attach0", jobs  # never a name %mesh spawn --job gives its own jobs
        assert mesh["run"], mesh  # the run its history is recorded under
        assert f"{jobs[0]['name']} (attach): running" in text(run(kc, "%mesh jobs").outputs)
        code, out, err = cli("kill-job", jobs[0]["name"])
        assert (code, out.strip()) == (0, f"job {jobs[0]['name']} killed with its meshes api_procs"), err
        assert worker.wait(30) == 0  # the job's end: the workers it attached exit
        assert text(run(kc, "%mesh jobs").outputs).startswith("no jobs")


def test_a_name_two_kernels_hold_is_refused_until_the_kernel_is_named(kernelspec):
    """Two kernels each with a mesh ``twin``: ``stop twin`` names both and exits 2 (bad usage);
    ``stop twin --kernel PID`` stops that kernel's alone."""
    from support.kernels import kernel

    with kernel(kernelspec) as a, kernel(kernelspec) as b:
        pids = {}
        for kc in (a, b):
            out, reply = run(kc, "twin = %mesh spawn -n 1\nimport os\nprint(os.getpid())")
            assert reply["status"] == "ok", text(out)
            pids[kc] = text(out).strip().splitlines()[-1]
        rows = [r for r in json.loads(cli("ls", "--json")[1]) if r["name"] == "twin" and r["kind"] == "mesh"]
        assert sorted(r["owner"] for r in rows) == sorted(f"kernel pid {p}" for p in pids.values()), rows
        assert all(r["run"] for r in rows) and rows[0]["run"] != rows[1]["run"], rows
        code, out, err = cli("stop", "twin")
        assert code == 2 and "2 kernels each hold a mesh named 'twin'" in err and "--kernel PID" in err, (out, err)
        for p in pids.values():
            assert f"pid {p}" in err, err
        code, out, err = cli("stop", "twin", "--kernel", pids[a])
        assert (code, out.strip()) == (0, "stopped mesh twin: its 1 rank ended"), err
        assert text(run(a, "%mesh list").outputs).startswith("no meshes")
        assert "twin: 1 rank, running" in text(run(b, "%mesh list").outputs)
        code, out, err = cli("stop", "twin", "--kernel", pids[a])
        assert code == 3 and f"no mesh or job named 'twin' in kernel {pids[a]}" in err, (out, err)


def test_attach_opens_a_console_on_a_detached_mesh(env, tmp_path, kernelspec):
    host = start_detached_host("dm", env, tmp_path / "host.log")
    try:
        code, out, err = cli("attach", "dm", "--simple-prompt", env=env, stdin="%mesh list\n")
        assert code == 0, err
        assert "* dm: 1 rank, running, detached" in out, out
        assert "attached detached mesh 'dm': 1 rank" in err
        code, out, err = cli("ls", "--json", env=env)
        (row,) = json.loads(out)
        assert row["state"] == "running" and row["attached"] is None  # the console's kernel ended; the mesh runs
        assert cli("stop", "dm", env=env)[0] == 0
    finally:
        end(host)
