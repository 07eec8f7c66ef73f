"""The run's history (issue 45, points 1 and 2): real ranks printing through the real output
path into Parquet files in 0700 folders, asked in SQL with DuckDB; metrics from ranks; deaths
recorded with their codes and signals; a size cap that drops the oldest files and says so."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys

import pytest
from support.config import configured
from support.waiting import until

import monarch_kernel
from monarch_kernel import Actor, endpoint, this_host

pytestmark = pytest.mark.timeout(120)


class Printer(Actor):
    @endpoint
    def chatter(self, n: int) -> int:
        import sys

        import monarch_kernel as mk

        r = mk.current_rank().rank
        for i in range(n):
            print(f"rank {r} line {i}")
            mk.metric("loss", 10.0 / (i + 1) + r, step=i)
        print(f"rank {r} complains", file=sys.stderr)
        return r

    @endpoint
    def spew(self, n: int) -> None:
        import os

        for i in range(n):  # incompressible, so the files grow
            print(f"{i} {os.urandom(48).hex()}")

    @endpoint
    def raw(self) -> None:
        """Lines as some programs write them: a Windows line end, a progress bar redrawn with
        ``\\r``, and bytes that are not UTF-8."""
        import os

        os.write(1, b"crlf line\r\nbar 10%\rbar 100%\r\nlatin \xe9t\xe9\nplain\n")

    @endpoint
    def leave(self, code: int) -> None:
        import os

        os._exit(code)




def test_ranks_lines_metrics_and_deaths_are_recorded_and_asked_in_sql(tmp_path):
    root = tmp_path / "hist"
    with configured(history_dir=str(root), history_flush=0.2, history_sample=0.3):
        procs = this_host().spawn_procs(per_host={"gpus": 3}, name="h-basic")
        try:
            p = procs.spawn("p", Printer)
            assert sorted(p.chatter.call(50).get(timeout=30).values()) == [0, 1, 2]
            h = monarch_kernel.history("h-basic")
            counts = until("150 lines", lambda: (df := h.sql(
                "SELECT rank, count(*) AS n FROM lines WHERE stream = 'stdout' GROUP BY rank ORDER BY rank")
            ) is not None and df["n"].tolist() == [50, 50, 50] and df)
            assert counts["rank"].tolist() == [0, 1, 2]
            # the control lines never show as lines; metrics carry rank, step and value
            assert h.sql("SELECT count(*) AS n FROM lines WHERE line LIKE '%metric%'")["n"][0] == 0
            m = until("metrics", lambda: (df := h.sql(
                "SELECT rank, count(*) AS n, min(step) AS lo, max(step) AS hi, min(value) AS v FROM metrics "
                "WHERE name = 'loss' GROUP BY rank ORDER BY rank")) is not None and len(df) == 3 and
                all(df["n"] == 50) and df)
            assert m["hi"].tolist() == [49, 49, 49] and m["v"].round(3).tolist() == [0.2, 1.2, 2.2]
            err = h.sql("SELECT rank, line FROM lines WHERE stream = 'stderr' ORDER BY rank")
            assert err["line"].tolist() == ["rank 0 complains", "rank 1 complains", "rank 2 complains"]
            first = h.sql("SELECT line FROM lines WHERE rank = 1 ORDER BY time LIMIT 1")["line"][0]
            assert first == "rank 1 line 0"
            # %mesh top's figures, sampled at the history's rate
            s = until("two samples of each rank", lambda: (df := h.sql(
                "SELECT rank, count(*) AS n, max(rss_mib) AS rss, count(cpu) AS cpus FROM samples GROUP BY rank "
                "ORDER BY rank")) is not None and len(df) == 3 and all(df["cpus"] >= 1) and df)
            assert all(s["rss"] > 1)
            # a death: code 3 on rank 1, a signal on rank 2 (the history keeps both)
            with pytest.raises(monarch_kernel.ProcessDied):
                p.slice(gpus=1).leave.call_one(3).get(timeout=30)
            pid2 = procs.rank_states()[2]["pid"]
            os.kill(pid2, signal.SIGKILL)
            ev = until("two deaths", lambda: (df := h.sql(
                "SELECT rank, kind, code, signal FROM events WHERE kind = 'exit' ORDER BY rank")) is not None and
                len(df) == 2 and df)
            assert ev["code"].tolist()[0] == 3 and ev["signal"].tolist()[1] == signal.SIGKILL
            assert h.sql("SELECT count(*) AS n FROM events WHERE kind = 'spawn'")["n"][0] == 1
            assert sorted(h.views) == ["events", "lines", "metrics", "samples", "stacks"]
        finally:
            procs.stop().get(timeout=30)
        # the folders are this user's alone, the files too
        for folder in [root, root / "h-basic", *(root / "h-basic").glob("*"), *(root / "h-basic").glob("*/*")]:
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        files = list((root / "h-basic").glob("*/*/*.parquet"))  # root/<mesh>/<run>/<host>/
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        listed = {r.name: r for r in monarch_kernel.history.list_histories(root)}
        rec = listed["h-basic"]
        assert rec.kind == "mesh" and rec.ranks == 3 and rec.hosts and rec.first <= rec.last
        until("the mesh to be listed as failed", lambda: {r.name: r for r in
                                                          monarch_kernel.history.list_histories(root)}[
            "h-basic"].state == "failed")


def test_a_host_over_its_cap_drops_its_oldest_files_and_records_it(tmp_path):
    root = tmp_path / "hist"
    cap = 1 << 20
    with configured(history_dir=str(root), history_flush=0.05, history_max_bytes=cap):
        procs = this_host().spawn_procs(per_host={"gpus": 1}, name="h-cap")
        try:
            p = procs.spawn("p", Printer)
            # 4.9 MB of lines, over the cap, in calls of 2,000: a loaded machine spools a call's
            # lines as one batch, and one of 8,000 (0.8 MB) alone outgrew what the cap keeps
            # (90% of 1 MiB), so it went whole once a newer batch came (fresh32, fresh65).
            for _ in range(24):
                p.spew.call(2000).get(timeout=60)
            h = monarch_kernel.history("h-cap")
            dropped = until("a history_dropped event", lambda: (df := h.sql(
                "SELECT detail FROM events WHERE kind = 'history_dropped'")) is not None and len(df) and df)
            assert "history_max_bytes" in dropped["detail"][0]
            def size() -> int:
                total = 0
                for f in root.glob("*/*/*/*.parquet"):
                    with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                        total += f.stat().st_size
                return total

            until(f"the history back under its cap of {cap:,} bytes", lambda: size() <= cap)
            # The newest kept (its last batch may still be on its way to a file), the oldest gone.
            def with_the_last_line():
                df = h.sql("SELECT max(TRY_CAST(split_part(line, ' ', 1) AS INT)) AS hi, count(*) AS n FROM lines")
                try:  # no line in a file yet: hi is NA (fresh34), which int() refuses
                    return df if df is not None and int(df["hi"][0]) == 1999 else None
                except (TypeError, ValueError):
                    return None

            got = until("the last call's last line", with_the_last_line)
            assert got["n"][0] < 24 * 2000
        finally:
            procs.stop().get(timeout=30)


def test_line_ends_are_taken_off_and_bytes_that_are_not_utf8_are_replaced(tmp_path):
    with configured(history_dir=str(tmp_path / "hist"), history_flush=0.05):
        procs = this_host().spawn_procs(per_host={"gpus": 1}, name="h-raw")
        try:
            procs.spawn("p", Printer).raw.call().get(timeout=60)
            h = monarch_kernel.history("h-raw")
            got = until("four lines", lambda: (df := h.sql("SELECT line FROM lines")) is not None
                        and len(df) >= 4 and df)
            assert sorted(got["line"]) == sorted(["crlf line", "bar 10%\rbar 100%", "latin \ufffdt\ufffd", "plain"])
        finally:
            procs.stop().get(timeout=30)


def test_metric_refuses_what_is_not_a_metric_and_says_what_to_give():
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        monarch_kernel.metric("", 1.0)
    with pytest.raises(TypeError, match="value must be a number, not str"):
        monarch_kernel.metric("loss", "high")
    with pytest.raises(TypeError, match="step must be an int or None"):
        monarch_kernel.metric("loss", 1.0, step=1.5)


def test_an_unknown_history_is_named_with_those_there(tmp_path):
    with pytest.raises(LookupError, match=r"no history named 'nope' under .* \(there: none\)"):
        monarch_kernel.history("nope", root=tmp_path)


def test_importing_the_package_loads_no_arrow_duckdb_or_pandas():
    code = ("import sys, monarch_kernel, monarch_kernel.history; "
            "print(sorted(m for m in ('pyarrow', 'duckdb', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_docs_page_shows_every_view_and_column_as_the_code_declares_them():
    import pathlib

    from monarch_kernel.history.columns import markdown

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "history.md"
    assert markdown().strip() in page.read_text(), (
        "docs/guides/history.md's tables differ from history/columns.py: paste "
        "`python -c 'from monarch_kernel.history.columns import markdown; print(markdown())'` in")
