"""Re-running a cell is safe: re-running ``procs = %mesh spawn -n 4`` keeps one mesh under
that name (reused when its options match and every rank runs, else stopped and replaced, the
cell saying which), never a second mesh beside the first; ``spawn_procs`` under a running mesh's
name stops it and starts the new one in its place, with a warning.  Through a real kernel and
real ranks; the naming rules without one."""

from __future__ import annotations

import argparse

import pytest
from support.kernels import run, text

from monarch_kernel.kernel.respawn import assigned_name, spawn_key, spawn_name

pytestmark = pytest.mark.timeout(180)


def meshes(kc) -> list[str]:
    return [line for line in text(run(kc, "%mesh list").outputs).splitlines() if line.strip()]


def test_rerunning_a_spawn_cell_reuses_or_replaces_the_mesh_and_says_so(kc):
    out, reply = run(kc, "procs = %mesh spawn -n 2\nprocs.name")
    assert reply["status"] == "ok" and "mesh procs: 2 ranks on this host" in text(out), text(out)
    run(kc, "%%mesh\nkept = 41")
    pids = text(run(kc, "[r['pid'] for r in procs.rank_states()]").outputs)

    out, reply = run(kc, "procs = %mesh spawn -n 2")  # the same cell again: the same mesh
    assert text(out) == ("mesh procs: reused; its 2 ranks still run, with their namespaces (spawned with the "
                         "same options; %mesh stop procs first for fresh ranks)\n"), text(out)
    assert meshes(kc) == ["* procs: 2 ranks, running"]
    assert text(run(kc, "[r['pid'] for r in procs.rank_states()]").outputs) == pids
    assert "[ranks 0-1] 42" in text(run(kc, "%%mesh\nkept + 1").outputs)

    out, reply = run(kc, "procs = %mesh spawn -n 1")  # edited and run again: replaced
    assert reply["status"] == "ok", text(out)
    assert text(out).splitlines() == [
        "mesh procs: stopped its 2 ranks (spawned with -n 2, now 1), to start the new ones in its place",
        "mesh procs: 1 rank on this host"], text(out)
    assert meshes(kc) == ["* procs: 1 rank, running"]

    out, reply = run(kc, "trainers = %mesh spawn -n 1")  # another variable: another mesh, named after it
    assert "mesh trainers: 1 rank on this host" in text(out), text(out)
    assert meshes(kc) == ["  procs: 1 rank, running", "* trainers: 1 rank, running"]

    # The API: the same name again (the cell run again) stops the running mesh and starts the
    # new one in its place, with a warning that says so; a spawn without a name gets a free one.
    cell = ("import warnings\nfrom monarch_kernel import this_host\nwarnings.simplefilter('always')\n"
            "q = this_host().spawn_procs(per_host={'r': 1}, name='api')\nq.name")
    out, reply = run(kc, cell)
    assert reply["status"] == "ok" and "MeshReplacedWarning" not in text(out), text(out)
    first = text(run(kc, "[r['pid'] for r in q.rank_states()]").outputs)
    out, reply = run(kc, "old = q\n" + cell)
    assert reply["status"] == "ok", text(out)
    assert ("MeshReplacedWarning: spawn_procs(name='api'): stopped the running mesh 'api' (1 rank) to start this "
            "one in its place; leave name= out to keep both") in text(out), text(out)
    assert text(run(kc, "print(old.stopped, q.stopped)").outputs).strip() == "True False"
    assert text(run(kc, "[r['pid'] for r in q.rank_states()]").outputs) != first
    run(kc, "q.stop().get()")
    out, reply = run(kc, "p = this_host().spawn_procs(per_host={'r': 1})\nprint(p.name)")
    api = text(out).strip()
    assert reply["status"] == "ok" and api not in ("procs", "trainers"), text(out)
    out, reply = run(kc, f"%mesh spawn -n 1 --name {api}")  # the magics do not stop the API's meshes
    assert reply["ename"] == "UsageError" and f"mesh {api!r} runs already, spawned with spawn_procs" in reply["evalue"]
    run(kc, "p.stop().get()")


def parsed(**given) -> argparse.Namespace:
    base = {"n": 4, "name": None, "detach": None, "env": [], "job": None}
    return argparse.Namespace(**{**base, **given})


def test_a_spawns_name_is_the_variable_it_is_assigned_to():
    cell = "x = 1\nprocs = %mesh spawn -n 4\ntrainers  =  %mesh  spawn -n 2 --env A=1\n"
    assert assigned_name(cell, "spawn -n 4") == "procs"
    assert assigned_name(cell, "spawn -n 2 --env A=1") == "trainers"
    assert assigned_name(cell, "spawn -n 8") is None
    assert spawn_name(parsed(), cell, "spawn -n 4") == "procs"
    assert spawn_name(parsed(), "%mesh spawn -n 4", "spawn -n 4") == "procs"  # not assigned: the default
    assert spawn_name(parsed(), "é = %mesh spawn -n 4", "spawn -n 4") == "procs"  # no file can be named so
    assert spawn_name(parsed(name="a"), "b = %mesh spawn -n 4 --name a", "spawn -n 4 --name a") == "a"
    assert spawn_key(parsed(name="a")) == spawn_key(parsed(name="b"))
    assert spawn_key(parsed(env=[("A", "1")])) != spawn_key(parsed())
