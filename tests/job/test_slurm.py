"""SlurmJob over a real Slurm (slurmctld + one slurmd per node namespace; see cluster.py):
2 nodes x 2 ranks answer from their own hostnames; an outside ``scancel`` fails pending
calls with ProcessDied naming the node within seconds; ``job.kill()`` leaves squeue empty and
nothing on any node (the fixture checks every namespace); a second process reattaches to the
same allocation with ``job_load``; Slurm's refusals reach the caller in Slurm's words.  The
``squeue --json`` parser and host-list expansion are tested on saved samples, without daemons."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import monarch_kernel
from monarch_kernel import Actor, ProcessDied, endpoint
from monarch_kernel.job import SlurmJob, job_load
from monarch_kernel.job.slurm import SlurmError
from monarch_kernel.job.squeue import base_state, expand_hostlist, find_job, number, parse_plain

pytestmark = pytest.mark.timeout(60)

DATA = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


class Node(Actor):
    @endpoint
    def host(self) -> tuple:
        return socket.gethostname(), os.environ.get("SLURM_JOB_ID"), os.getpid()

    @endpoint
    def nap(self, s: float) -> str:
        time.sleep(s)
        return "woke"


# ------------------------------------------------------------------------- parsing (no daemons)


@pytest.mark.parametrize("text, names", [
    ("mkn[1-2]", ["mkn1", "mkn2"]),
    ("n[1-3,5],gpu[01-02]", ["n1", "n2", "n3", "n5", "gpu01", "gpu02"]),
    ("login1", ["login1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu-[3]-x", ["gpu-3-x"]),
    ("", []),
])
def test_hostlists_expand_in_slurms_order(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("bad", ["n[1-2", "n[a-b]", "n[3-1]", "n1-2]"])
def test_a_bad_hostlist_says_which(bad):
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(bad)


@pytest.mark.parametrize("name", ["squeue-22.05.json", "squeue-24.05.json"])
def test_squeue_json_of_both_layouts(name):
    data = json.loads((DATA / name).read_text())
    running = find_job(data, "1")
    assert running is not None and running.running and not running.ended
    assert (running.state, running.nodes, running.partition, running.name) == (
        "RUNNING", ("mkn1", "mkn2"), "mk", "mesh-ranks")
    pending = find_job(data, "2")
    assert pending is not None and (pending.state, pending.nodes, pending.reason) == ("PENDING", (), "Resources")
    assert find_job(data, "3") is None  # 22.05 may list every job whatever -j asked: we filter


def _variant(name: str, edit) -> dict:
    data = json.loads((DATA / name).read_text())
    job = copy.deepcopy(data["jobs"][0])
    edit(job)
    return {"jobs": [job]}


def test_squeue_json_variants_between_and_beyond_the_samples():
    def v23(job):  # 23.11: list job_state, numbers as objects, but 22.05's allocated_nodes[].nodename
        job["job_state"] = ["RUNNING"]
        job["job_id"] = {"set": True, "infinite": False, "number": 1}
        job["job_resources"].pop("nodes")

    assert find_job(_variant("squeue-22.05.json", v23), "1").nodes == ("mkn1", "mkn2")

    def only_lists(job):  # no allocation array: the host-list strings are enough
        job["job_resources"]["nodes"].pop("allocation")

    assert find_job(_variant("squeue-24.05.json", only_lists), "1").nodes == ("mkn1", "mkn2")

    def no_resources(job):  # 24.11 gives null; 22.05 leaves the key out
        job["job_resources"] = None
        job["nodes"] = "mkn[3-4]"

    assert find_job(_variant("squeue-24.05.json", no_resources), "1").nodes == ("mkn3", "mkn4")

    def ended(job):
        job["job_state"] = ["CANCELLED"]

    gone = find_job(_variant("squeue-24.05.json", ended), "1")
    assert gone.ended and not gone.running
    assert base_state(["PENDING", "REQUEUED"]) == "PENDING" and base_state("running") == "RUNNING"
    assert number({"set": False, "infinite": False, "number": 0}) is None and number(4) == 4
    assert number({"set": True, "infinite": True, "number": 0}) is None
    plain = parse_plain("RUNNING|mkn[1-2]|mk|None|monarch", "7")
    assert (plain.job_id, plain.state, plain.nodes, plain.name) == ("7", "RUNNING", ("mkn1", "mkn2"), "monarch")


def test_commands_carry_the_options_and_no_secret(monkeypatch):
    job = SlurmJob(meshes={"a": 2, "b": 1}, partition="gpu", time_limit="01:00:00", gpus_per_node=4,
                   cpus_per_task=16, mem="64G", account="proj", qos="high", slurm_args=("--constraint=h100",))
    argv = job.sbatch_command()
    assert argv[:3] == ["sbatch", "--parsable", "--nodes=3"]
    for flag in ("--job-name=monarch", "--time=01:00:00", "--partition=gpu", "--gpus-per-node=4",
                 "--cpus-per-task=16", "--mem=64G", "--account=proj", "--qos=high", "--exclusive"):
        assert flag in argv
    assert argv[-1] == "--constraint=h100"
    script = job.hold_script()
    assert "key" not in script.lower() and "-ge 300" not in script and "-lt 300" in script and "monarch-agent" in script
    assert "exec sleep infinity" in SlurmJob(meshes={"a": 1}, idle_timeout=None).hold_script()
    job.job_id = "42"
    srun = job.command("gpu07")
    assert srun[:6] == ["srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu07"]
    assert srun[-3:] == [sys.executable, "-m", "monarch_kernel.agent"]
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    monkeypatch.setenv("MONARCH_KERNEL_BIND", "10.0.0.1")
    env = job.environment()
    assert "SLURM_JOB_ID" not in env and "MONARCH_KERNEL_BIND" not in env
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    with pytest.raises(TypeError, match="sequence of sbatch arguments"):
        SlurmJob(meshes={"a": 1}, slurm_args="--exclusive")
    with pytest.raises(ValueError, match="positive ints"):
        SlurmJob(meshes={"a": 0})


def test_no_sbatch_on_path_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match="Slurm's sbatch is not on PATH"):
        SlurmJob(meshes={"m": 1}).state()


# ------------------------------------------------------------------------- a real Slurm


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
    return slurm_cluster


@pytest.fixture
def job(slurm):
    job = SlurmJob(meshes={"m": 2})
    yield job
    job.kill()


def test_two_nodes_answer_from_their_own_hostnames_and_kill_frees_the_allocation(job, slurm):
    t0 = time.monotonic()
    state = job.state()
    assert job.scheduling_delay_s is not None and job.scheduling_delay_s <= time.monotonic() - t0
    assert job.nodes == slurm.nodes and job.allocated_partition == slurm.partition
    assert state.m.host_names == slurm.nodes
    procs = state.m.spawn_procs(per_host={"gpus": 2})
    got = procs.spawn("node", Node).host.call().get(timeout=30)
    first = time.monotonic() - t0
    assert procs.extent == {"hosts": 2, "gpus": 2}
    assert [got[{"hosts": h, "gpus": g}][:2] for h in range(2) for g in range(2)] == [
        (slurm.nodes[h], job.job_id) for h in range(2) for _ in range(2)]
    assert len({v[2] for v in got.values()}) == 4
    print(f"\nSlurm 2x2: first answer {first:.2f} s after state(), of which scheduling "
          f"{job.scheduling_delay_s:.2f} s")
    assert [j["job_id"] for j in slurm.jobs()] == [job.job_id]
    job.kill()
    assert slurm.jobs() == [] and not job.active
    assert slurm.check_clean() == ""  # no step, agent or rank left on either node


@pytest.mark.timeout(180)
def test_a_slurm_jobs_history_is_copied_home_when_it_is_killed_and_answers_after(job, slurm, tmp_path):
    """Each node's agent writes its ranks' lines and metrics on that node; ``job.kill()`` copies
    them home before ``scancel``, so the history answers once the nodes' folders are gone."""
    # here, not at the top: the second process of a test below imports this module without support/
    from support.actors import Talker
    from support.config import configured

    home, away = tmp_path / "home", tmp_path / "nodes"
    with configured(history_dir=str(home), history_flush=0.2):
        procs = job.state().m.spawn_procs(per_host={"gpus": 2}, name="s-job",
                                          env={"MONARCH_KERNEL_HISTORY_DIR": str(away)})
        hosts = procs.spawn("t", Talker).talk.call(20).get(timeout=60)
        assert sorted(set(hosts.values())) == slurm.nodes
        procs.stop().get(timeout=60)
        job.kill()
        assert (away / "s-job").is_dir(), "the nodes wrote no history of their own"
        shutil.rmtree(away)  # the allocation is gone, and its disks with it
        h = monarch_kernel.history("s-job")
        got = h.sql("SELECT host, rank, count(*) AS n FROM lines GROUP BY host, rank ORDER BY rank")
        assert got["rank"].tolist() == [0, 1, 2, 3] and got["n"].tolist() == [20] * 4
        assert got["host"].tolist() == [slurm.nodes[0]] * 2 + [slurm.nodes[1]] * 2
        m = h.sql("SELECT rank, count(*) AS n, min(value) AS low FROM metrics GROUP BY rank ORDER BY rank")
        assert m["n"].tolist() == [20] * 4 and m["low"].tolist() == [0.05] * 4
        assert {"spawn", "stop"} <= set(h.sql("SELECT DISTINCT kind FROM events")["kind"])
        rec = {r.name: r for r in monarch_kernel.history.list_histories()}["s-job"]
        assert rec.kind == "job" and set(slurm.nodes) <= set(rec.hosts)


def test_two_meshes_split_the_nodes_in_order_and_a_squeue_without_json_will_do(slurm, tmp_path, monkeypatch):
    fake = tmp_path / "bin"  # a squeue built without its JSON plugins: the plain format is read instead
    fake.mkdir()
    (fake / "squeue").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {fake}/calls
        for a in "$@"; do [ "$a" = --json ] && {{ echo "squeue: unrecognized option '--json'" >&2; exit 1; }}; done
        exec {shutil.which("squeue")} "$@"
    """))
    (fake / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    job = SlurmJob(meshes={"a": 1, "b": 1})
    try:
        state = job.state()
        assert (state.a.host_names, state.b.host_names) == ([slurm.nodes[0]], [slurm.nodes[1]])
        b = state.b.spawn_procs(per_host={"gpus": 1}).spawn("node", Node)
        assert b.host.call_one().get(timeout=30)[0] == slurm.nodes[1]
        with pytest.raises(AttributeError, match="its meshes: a, b"):
            state.c  # noqa: B018
    finally:
        job.kill()
    assert slurm.jobs() == []
    assert "--format=%T|%N|%P|%r|%j" in (fake / "calls").read_text()


def test_scancel_from_outside_fails_pending_calls_naming_the_node(job, slurm):
    procs = job.state().m.spawn_procs(per_host={"gpus": 1})
    m = procs.spawn("node", Node)
    m.host.call().get(timeout=30)
    pending = m.slice(hosts=0).nap.call(30)
    other = m.slice(hosts=1).nap.call(30)
    time.sleep(0.3)
    slurm.run("scancel", job.job_id)
    t = time.monotonic()
    # Slurm signals the step's processes as srun exits: whichever the controller hears first
    # names the node (the agent's report of its rank, or the launcher's exit).
    node = slurm.nodes[0]
    with pytest.raises(ProcessDied, match=rf"its host {node} is gone: its launcher \(srun\) exited"
                                          rf"|on {node}\) killed by signal 15"):
        pending.get(timeout=20)
    assert time.monotonic() - t < 5
    with pytest.raises(ProcessDied, match=slurm.nodes[1]):
        other.get(timeout=20)


def test_job_load_reattaches_a_second_process_to_the_same_allocation(job, slurm, tmp_path):
    job.state().m.spawn_procs(per_host={"gpus": 1}).spawn("node", Node).host.call().get(timeout=30)
    path = str(tmp_path / "job.json")
    job.dump(path)
    spec = json.loads(pathlib.Path(path).read_text())
    assert spec["kind"] == "slurm" and spec["job_id"] == job.job_id and "key" not in json.dumps(spec).lower()
    script = tmp_path / "second.py"
    script.write_text(textwrap.dedent(f'''
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from monarch_kernel.job import job_load
        from test_slurm import Node
        job = job_load({path!r})
        procs = job.state().m.spawn_procs(per_host={{"gpus": 2}})
        got = procs.spawn("node", Node).host.call().get(timeout=30)
        print(job.job_id, job.scheduling_delay_s, sorted(v[0] for v in got.values()), flush=True)
        time.sleep(60)
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split(" ", 2)
        assert line[:2] == [job.job_id, "None"], line  # the same allocation; nothing was queued
        assert line[2].strip() == str(sorted(slurm.nodes * 2))
        assert [j["job_id"] for j in slurm.jobs()] == [job.job_id]  # no second sbatch
    finally:
        proc.kill()  # it dies without cleaning up: its srun steps see EOF, and its agents and ranks end
        proc.wait(10)
        proc.stdout.close()
    again = job.state().m.spawn_procs(per_host={"gpus": 1}, name="again").spawn("node", Node)
    assert sorted(v[0] for v in again.host.call().get(timeout=30).values()) == slurm.nodes  # ours still work
    job.kill()
    assert slurm.jobs() == []
    with pytest.raises(SlurmError, match=rf"dumped Slurm job {spec['job_id']} .*allocation is gone"):
        job_load(path).state()


def test_refusals_and_hopeless_requests_say_what_slurm_said(slurm):
    with pytest.raises(SlurmError, match="(?s)sbatch refused the allocation .*Invalid partition name specified"):
        SlurmJob(meshes={"m": 1}, partition="nope").state()
    with pytest.raises(SlurmError, match="cannot run as asked .*PartitionNodeLimit.*fewer nodes"):
        SlurmJob(meshes={"m": len(slurm.nodes) + 1}).state()
    assert slurm.jobs() == []  # the hopeless job was cancelled
    with pytest.raises(ConnectionError, match="/nonexistent/python cannot be run there; pass python_exe="):
        SlurmJob(meshes={"m": 1}, python_exe="/nonexistent/python", start_timeout=20).state()
    assert slurm.jobs() == []


def test_job_start_timeout_cancels_a_job_still_pending(slurm):
    hog = slurm.run("sbatch", "--parsable", f"-N{len(slurm.nodes)}", "--exclusive", "-o", "/dev/null",
                    "--wrap", "sleep 300").stdout.strip()
    try:
        with pytest.raises(TimeoutError, match=r"still PENDING( \(reason: \w+\))? after 2 s, so it is cancelled"):
            SlurmJob(meshes={"m": 1}, job_start_timeout=2).state()
        assert [j["job_id"] for j in slurm.jobs()] == [hog]
    finally:
        slurm.run("scancel", hog)
        deadline = time.monotonic() + 15
        while slurm.jobs() and time.monotonic() < deadline:
            time.sleep(0.1)


def test_a_dead_controller_leaves_no_allocation_once_idle(slurm, tmp_path):
    """The controller is SIGKILLed without kill(): its agents end (srun's stdin closes), and
    the hold script ends the allocation once no agent step has run for idle_timeout."""
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(f'''
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from monarch_kernel.job import SlurmJob
        from test_slurm import Node
        job = SlurmJob(meshes={{"m": 2}}, idle_timeout=5)
        procs = job.state().m.spawn_procs(per_host={{"gpus": 1}})
        procs.spawn("node", Node).host.call().get(timeout=30)
        print(job.job_id, flush=True)
        time.sleep(120)
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        job_id = proc.stdout.readline().strip()
        assert job_id and [j["job_id"] for j in slurm.jobs()] == [job_id]
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    deadline = time.monotonic() + 40
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.jobs() == [], "the allocation outlived its controller past idle_timeout"
