"""A run's own history: each spawn of a mesh is a run, written in a folder of its own, so a mesh
spawned again under its name (a cell or a notebook run again) never mixes its lines with the
old run's.  The default query reads the latest run, ``run=`` another, ``run="all"`` every run
with its id; the listing has one record per run; a folder of the layout before runs still
lists and reads (as the run ``legacy``); the size cap drops the oldest run's files first."""

from __future__ import annotations

import contextlib
import json
import socket

import pytest
from support.config import configured
from support.waiting import until

import monarch_kernel
from monarch_kernel import Actor, endpoint, this_host

pytestmark = pytest.mark.timeout(180)


class Speaker(Actor):
    @endpoint
    def say(self, n: int, word: str) -> int:
        import monarch_kernel as mk

        r = mk.current_rank().rank
        for i in range(n):
            print(f"{word} {r} {i}")
        return r

    @endpoint
    def spew(self, n: int, word: str) -> None:
        import os

        for i in range(n):  # incompressible, so the files grow
            print(f"{word} {i} {os.urandom(48).hex()}")




def _runs(root, name: str) -> list:
    return [r for r in monarch_kernel.history.list_histories(root) if r.name == name]


def test_a_mesh_spawned_again_under_its_name_is_a_run_of_its_own(tmp_path):
    root = tmp_path / "hist"
    with configured(history_dir=str(root), history_flush=0.2):
        first = this_host().spawn_procs(per_host={"gpus": 2}, name="h-runs")
        try:
            first.spawn("s", Speaker).say.call(3, "one").get(timeout=30)
        finally:
            first.stop().get(timeout=30)
        second = this_host().spawn_procs(per_host={"gpus": 1}, name="h-runs")
        try:
            second.spawn("s", Speaker).say.call(2, "two").get(timeout=30)
            # the default: the latest run's lines only
            h = monarch_kernel.history("h-runs")
            got = until("the second run's 2 lines", lambda: (df := h.sql(
                "SELECT run, rank, line FROM lines ORDER BY time")) is not None and len(df) == 2 and df)
            assert got["line"].tolist() == ["two 0 0", "two 0 1"], got
            runs = until("two runs listed", lambda: len(r := _runs(root, "h-runs")) == 2 and r)
            new, old = runs  # the latest started first
            assert old.run < new.run, (old.run, new.run)  # run ids sort by time
            assert got["run"].unique().tolist() == [new.run] and h.run == new.run
            assert (old.ranks, new.ranks) == (2, 1) and old.state == "ended" and new.state == "running"
            assert old.folder.parent == new.folder.parent == root / "h-runs"
            assert [p.name for p in old.folder.iterdir()] == [socket.gethostname()]
            # a ProcMesh keeps its own run, also once another took its name
            assert monarch_kernel.history(first).run == old.run
            assert monarch_kernel.history(second).run == new.run
            # run=: another run, by its id or the start of it
            older = monarch_kernel.history("h-runs", run=old.run).sql(
                "SELECT run, rank, count(*) AS n FROM lines GROUP BY ALL ORDER BY rank")
            assert older.to_dict("list") == {"run": [old.run] * 2, "rank": [0, 1], "n": [3, 3]}
            assert monarch_kernel.history("h-runs", run=old.run[:-3]).run == old.run
            with pytest.raises(LookupError, match=r"'h-runs' has no run 'nope' under .*; its runs, newest first: "
                                                  + new.run + ", " + old.run):
                monarch_kernel.history("h-runs", run="nope")
            # run="all": both, each line with its run
            every = monarch_kernel.history("h-runs", run="all")
            assert every.run == "all"
            both = every.sql("SELECT run, count(*) AS n, min(line) AS first FROM lines GROUP BY run ORDER BY run")
            assert both.to_dict("list") == {"run": [old.run, new.run], "n": [6, 2], "first": ["one 0 0", "two 0 0"]}
            spawns = every.sql("SELECT run, mesh, detail FROM events WHERE kind = 'spawn' ORDER BY run")
            assert spawns["run"].tolist() == [old.run, new.run] and set(spawns["mesh"]) == {"h-runs"}
            assert every.sql("SELECT * FROM lines LIMIT 0").columns.tolist()[:5] == [
                "time", "mesh", "run", "host", "rank"]
        finally:
            second.stop().get(timeout=30)


def test_runs_list_by_when_they_began_not_when_their_rows_were_first_written(tmp_path):
    """Two spawns in quick succession: the older run's rows may land in the same batch as the
    newer's, or after them (fresh19); the listing still puts the newer run first, by its id."""
    from monarch_kernel.history import places

    older, newer = places.new_run(1_000_000.0), places.new_run(1_000_000.3)
    for run, written in ((older, 1_000_002.0), (newer, 1_000_001.0)):  # the older one's rows written last
        places.write_meta(places.host_dir(tmp_path, "quick", run, "h"),
                          {"name": "quick", "run": run, "first": written, "last": written, "state": "ended"})
    got = [r for r in monarch_kernel.history.list_histories(tmp_path) if r.name == "quick"]
    assert [r.run for r in got] == [newer, older]
    assert [r.first for r in got] == [1_000_000.3, 1_000_000.0]  # when each began


def _write_old_layout(root, name: str, host: str) -> None:
    """A history as the code before runs wrote it: root/<mesh>/<host>/, its meta.json and files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / name / host
    folder.mkdir(parents=True, mode=0o700)
    (folder / "meta.json").write_text(json.dumps({
        "name": name, "kind": "mesh", "first": 1_700_000_000.0, "last": 1_700_000_060.0, "host": host, "pid": 1,
        "hosts": [host], "state": "ended", "ranks": 2}))
    now = 1_700_000_000_000_000
    table = pa.table({
        "time": pa.array([now, now + 1, now + 2], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "mesh": [name] * 3, "host": [host] * 3, "rank": pa.array([0, 1, 1], pa.int32()),
        "stream": ["stdout"] * 3, "cell": pa.array([None] * 3, pa.string()), "line": ["old a", "old b", "old c"]})
    pq.write_table(table, folder / f"lines-{now * 1000}-1-1.parquet")


def test_a_folder_of_the_layout_before_runs_lists_and_reads_as_one_run(tmp_path):
    root = tmp_path / "hist"
    _write_old_layout(root, "h-old", "oldhost")
    # what the listing must step over, never failing on it
    (root / "stray-file").write_text("not a history")
    (root / "h-bad" / "somehost").mkdir(parents=True)
    (root / "h-bad" / "somehost" / "meta.json").write_text("[1, 2")
    (root / "h-odd" / "otherhost").mkdir(parents=True)
    (root / "h-odd" / "otherhost" / "meta.json").write_text(json.dumps({"first": "when?", "ranks": "many"}))
    (root / "h-empty" / "20261205T000000.000Z-abcdef").mkdir(parents=True)
    (legacy,) = monarch_kernel.history.list_histories(root)
    assert (legacy.name, legacy.run, legacy.state, legacy.ranks, legacy.hosts) == (
        "h-old", "legacy", "ended", 2, ["oldhost"])
    got = monarch_kernel.history("h-old", root=root).sql("SELECT run, rank, line FROM lines ORDER BY time")
    assert got.to_dict("list") == {"run": ["legacy"] * 3, "rank": [0, 1, 1], "line": ["old a", "old b", "old c"]}
    # a new run of that name beside it: listed apart, the default; the old one still by run=
    with configured(history_dir=str(root), history_flush=0.2):
        procs = this_host().spawn_procs(per_host={"gpus": 1}, name="h-old")
        try:
            procs.spawn("s", Speaker).say.call(1, "new").get(timeout=30)
            runs = until("the new run listed", lambda: len(r := _runs(root, "h-old")) == 2 and r)
            assert runs[1].run == "legacy" and runs[0].run != "legacy"
            assert until("the new run's line", lambda: (df := monarch_kernel.history("h-old").sql(
                "SELECT line FROM lines")) is not None and len(df) and df)["line"].tolist() == ["new 0 0"]
            assert monarch_kernel.history("h-old", run="legacy").sql("SELECT count(*) AS n FROM lines")["n"][0] == 3
            every = monarch_kernel.history("h-old", run="all").sql(
                "SELECT run, count(*) AS n FROM lines GROUP BY run ORDER BY n")
            assert every.to_dict("list") == {"run": [runs[0].run, "legacy"], "n": [1, 3]}
        finally:
            procs.stop().get(timeout=30)


def test_the_size_cap_drops_the_oldest_runs_files_first(tmp_path):
    root = tmp_path / "hist"
    cap = 1 << 20
    with configured(history_dir=str(root), history_flush=0.05, history_max_bytes=cap):
        old = this_host().spawn_procs(per_host={"gpus": 1}, name="h-cap-runs")
        try:
            s = old.spawn("s", Speaker)
            for _ in range(3):  # about 0.7 of the cap once in Parquet: nothing dropped yet
                s.spew.call(4000, "old").get(timeout=60)
                # A query converts what is spooled first.  Without it, on a loaded machine the
                # writer (nice 19) lagged, and the spool's raw bytes (twice the Parquet's) went
                # over the cap: the disk really held that much, so the oldest batch went (fresh67).
                monarch_kernel.history(old).sql("SELECT count(*) AS n FROM lines")
        finally:
            old.stop().get(timeout=30)
        until("the old run's 12,000 lines, none dropped", lambda: monarch_kernel.history(old).sql(
            "SELECT count(*) AS n FROM lines")["n"][0] == 12000)
        new = this_host().spawn_procs(per_host={"gpus": 1}, name="h-cap-runs")
        try:
            new.spawn("s", Speaker).spew.call(8000, "new").get(timeout=60)  # about 0.5 of it: over, together
            every = monarch_kernel.history("h-cap-runs", run="all")
            dropped = until("a history_dropped event", lambda: (df := every.sql(
                "SELECT run, detail FROM events WHERE kind = 'history_dropped'")) is not None and len(df) and df)
            (latest, oldest) = _runs(root, "h-cap-runs")
            assert set(dropped["run"]) == {oldest.run}, dropped  # only the oldest run lost files

            def size() -> int:
                total = 0
                for f in root.glob("*/*/*/*.parquet"):
                    with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                        total += f.stat().st_size
                return total

            until(f"the history back under its cap of {cap:,} bytes", lambda: size() <= cap)

            def by_run() -> dict:
                got = every.sql("SELECT run, count(*) AS n FROM lines GROUP BY run")
                return dict(zip(got["run"], got["n"], strict=True))

            # the newest run whole: its last lines may still be on their way to the recorder (a
            # loaded machine) when the call has returned; a dropped file of it would never come back
            n = until("the newest run's 8,000 lines", lambda: (got := by_run()).get(latest.run) == 8000 and got)
            assert n.get(oldest.run, 0) < 12000, n  # the oldest run's oldest lines gone
        finally:
            new.stop().get(timeout=30)
