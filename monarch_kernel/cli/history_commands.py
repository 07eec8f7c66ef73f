"""``monarch-kernel logs`` and ``monarch-kernel history``: a mesh's or job's history on disk
(``monarch_kernel.history``), which outlives its kernel and its allocation, read with no
kernel running.  Reads only.
"""

from __future__ import annotations

import datetime
import re
import time

import click

from ..runtime import config
from . import shared_help
from .output import Failed, NotFound, emit, json_option

_SINCE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FOLLOW_S = config.seconds("logs_follow")  # how often --follow looks for new lines
LAG_S = config.seconds("logs_follow_lag")  # how late a host's lines may land and still be printed


def open_history(name: str, root: str | None, as_json: bool, run: str | None = None):
    from .. import history

    try:
        return history.open_history(name, root=root, run=run)
    except history.HistoryNotFound as e:
        raise NotFound(str(e).replace("`%mesh history --list` lists them", "monarch-kernel ls lists them"),
                       as_json) from None


def sql(h, query: str, as_json: bool):
    import duckdb

    try:
        return h.sql(query)
    except duckdb.Error as e:
        raise Failed(f"the query failed: {e}", as_json) from None


def since_time(text: str) -> datetime.datetime:
    """``10m``, ``2h``, ``30s``, ``1d`` ago, or an ISO time (UTC unless it says)."""
    m = _SINCE.match(text.strip())
    if m:
        return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
            seconds=float(m[1]) * _UNITS[m[2]])
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give a duration (30s, 10m, 2h, 1d) or a time "
                                 "(2026-12-04T03:00:00)", param_hint="--since") from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _ranks(spec: str | None, n: int | None) -> list[int] | None:
    if spec is None:
        return None
    from ..runtime import RankSpecError, parse_ranks

    try:
        return parse_ranks(spec, n or 1 << 20)
    except RankSpecError as e:
        raise click.BadParameter(str(e), param_hint="--rank") from None


@click.command("logs")
@click.argument("name")
@click.option("--rank", "rank_spec", metavar="R", help="only these ranks: 3, 0-3, 0,2 (default: all)")
@click.option("--since", metavar="10m|TIME", help="only lines since then: 30s, 10m, 2h, 1d ago, or a time")
@click.option("--follow", "-f", is_flag=True, help="keep printing new lines while the mesh runs (Ctrl-C ends it)")
@click.option("--run", metavar="RUN", help=shared_help.option("history", "run"))
@click.option("--root", metavar="DIR", help=shared_help.option("history", "root"))
@json_option
def logs(name: str, rank_spec: str | None, since: str | None, follow: bool, run: str | None, root: str | None,
         as_json: bool) -> None:
    """every rank's lines of a mesh, from its history (also after its kernel and allocation ended)"""
    h = open_history(name, root, as_json, run)
    ranks = _ranks(rank_spec, h.record.ranks if h.record is not None else None)
    where = [f"rank IN ({', '.join(map(str, ranks))})"] if ranks is not None else []
    after = since_time(since) if since else None
    shown: set[tuple] = set()  # with --follow: the lines of the last LAG_S seconds already printed
    while True:
        # asked before the lines are read: a run said ended has its last lines on disk already
        ended = follow and _ended(h, root)
        clauses = where + ([f"time >= TIMESTAMPTZ '{after.isoformat()}'"] if after is not None else [])
        query = ("SELECT time, rank, stream, line FROM lines" + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
                 + " ORDER BY time, rank")
        for row in sql(h, query, as_json).itertuples(index=False):
            key = (row.time, row.rank, row.stream, row.line)
            if key in shown:
                continue
            if follow:
                shown.add(key)
            if as_json:
                click.echo(emit_line(row))
            else:
                who = "controller" if row.rank != row.rank else f"rank {int(row.rank)}"  # NaN: the mesh's own
                click.echo(f"[{who}]{' (stderr)' if row.stream == 'stderr' else ''} {row.line}")
        if not follow:
            return
        # Hosts write their lines in batches, so one may land later with earlier times: look
        # back LAG_S seconds each time, and skip what was printed.
        after = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=LAG_S)
        shown = {k for k in shown if k[0] >= after}
        if ended:
            return
        try:
            time.sleep(FOLLOW_S)
        except KeyboardInterrupt:
            return


def _ended(h, root: str | None) -> bool:
    """Whether every run ``h`` reads has ended (or is gone)."""
    from .. import history

    runs = {r.run for r in h.runs}
    now = [r for r in history.list_histories(root) if r.name == h.name and r.run in runs]
    return bool(now) and all(r.state != "running" for r in now)  # none listed: being rewritten, not ended


def emit_line(row) -> str:
    import json

    return json.dumps({"time": row.time.isoformat(), "rank": None if row.rank != row.rank else int(row.rank),
                       "stream": row.stream, "line": row.line})


@click.command("history", help=shared_help.about("history"))
@click.argument("name")
@click.argument("query", metavar='"SQL"')
@click.option("--run", metavar="RUN", help=shared_help.option("history", "run"))
@click.option("--root", metavar="DIR", help=shared_help.option("history", "root"))
@json_option
def history_command(name: str, query: str, run: str | None, root: str | None, as_json: bool) -> None:
    df = sql(open_history(name, root, as_json, run), query, as_json)
    if df is None:
        emit(as_json, [], "")
        return
    emit(as_json, None if not as_json else _records(df), df.to_string(index=False))


def _records(df) -> list[dict]:
    import json

    return json.loads(df.to_json(orient="records", date_format="iso"))
