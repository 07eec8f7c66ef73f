"""The ``monarch-kernel`` command group (also ``python -m monarch_kernel``), on click.  Each
subcommand finds its NAME (``targets.py``) and acts through the public API: a detached
mesh through a short-lived controller in this process, a running kernel's mesh or job
through that kernel.  No kernel needs to run.  Exit codes: 0 ok, 1 failed, 2 bad usage,
3 not found.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import click

from ..detached import listing
from ..observe.metrics import RankMetrics, top_table
from . import progress, shared_help
from .history_commands import history_command, logs
from .output import Failed, emit, json_option, table
from .targets import Target, everything, find

LS_COLUMNS = ["name", "kind", "state", "ranks", "hosts", "owner", "attached", "run"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.pass_context
def main(ctx: click.Context) -> None:
    """The meshes and jobs of your notebooks, from a terminal: list them, read their stacks
    and load, stop them, open a console on one.  No kernel needs to run.

    Exit codes: 0 ok, 1 failed, 2 bad usage, 3 not found.  --json: one JSON document.
    """
    ctx.call_on_close(_end_runtime)


def _end_runtime() -> None:
    """The short-lived controller this command may have started ends with it."""
    from ..runtime import Runtime

    rt = Runtime.existing()
    if rt is not None:
        rt.shutdown()


@main.command("ls")
@json_option
def ls(as_json: bool) -> None:
    """the meshes and jobs: detached, of running kernels, and finished (with a history)"""
    rows = [t.row for t in everything()]
    emit(as_json, rows, table(rows, LS_COLUMNS) if rows else
         "no meshes or jobs; start one in a notebook with  procs = %mesh spawn -n 4 --detach NAME")


kernel_option = click.option("--kernel", metavar="PID", help="the kernel that holds NAME (its pid, or the start of "
                             "its id), where two kernels each hold one of that name")


@main.command("stop")
@click.argument("name")
@kernel_option
@json_option
def stop(name: str, kernel: str | None, as_json: bool) -> None:
    """end a mesh: its ranks (and a detached mesh's host process) end"""
    target = find(name, as_json, ("mesh",) if kernel else ("detached", "mesh"), kernel)
    if target.kind == "mesh":
        said = _through_kernel(target, f"%mesh stop {name}", as_json)
    else:
        if target.row["state"] != "running":
            listing.records.forget(name)
            raise Failed(f"detached mesh {name!r} was gone already (its host process exited); removed its record",
                         as_json)
        record = target.record
        assert record is not None
        try:
            progress.ending(f"stopping {name}", _local_pids(record, as_json), lambda: listing.stop(record), as_json)
        except (TimeoutError, OSError) as e:
            raise Failed(f"stopping detached mesh {name!r} failed: {e}", as_json) from None
        said = f"stopped detached mesh {name!r}: its {_ranks(target)} and its host process ended"
    emit(as_json, {"name": name, "stopped": True, "message": said}, said)


@main.command("kill-job", help=shared_help.about("kill-job"))
@click.argument("name")
@kernel_option
@json_option
def kill_job(name: str, kernel: str | None, as_json: bool) -> None:
    target = find(name, as_json, ("job",) if kernel else ("job", "detached"), kernel)
    if target.kind == "job":
        said = _through_kernel(target, f"%mesh kill-job {name}", as_json)
    elif target.record is not None and target.record.job:  # a detached mesh's own job ends with it
        if target.row["state"] != "running":
            raise Failed(f"detached mesh {name!r} and its job are gone already", as_json)
        record = target.record
        progress.ending(f"killing {name}'s job", _local_pids(record, as_json), lambda: listing.stop(record), as_json)
        said = f"job of detached mesh {name!r} killed with its mesh ({target.record.job['kind']})"
    else:
        raise Failed(f"{name!r} is a detached mesh on this machine, with no job: monarch-kernel stop {name}", as_json)
    emit(as_json, {"name": name, "killed": True, "message": said}, said)


@main.command("stacks", help=shared_help.about("stacks"))
@click.argument("name")
@click.argument("ranks", required=False, metavar="[RANKS]")
@click.option("--native", is_flag=True, help=shared_help.option("stacks", "native"))
@click.option("--all-threads", is_flag=True, help=shared_help.option("stacks", "all_threads"))
@click.option("--runtime-frames", is_flag=True, help=shared_help.option("stacks", "runtime_frames"))
@click.option("--py-spy", "py_spy", is_flag=True, help=shared_help.option("stacks", "py_spy"))
@json_option
def stacks(name: str, ranks: str | None, native: bool, all_threads: bool, runtime_frames: bool, py_spy: bool,
           as_json: bool) -> None:
    procs = _detached_mesh(name, "stacks", as_json)
    chosen = _rank_list(ranks, len(procs)) if ranks else None
    report = procs.stacks(chosen, native=native, all_threads=all_threads, runtime_frames=runtime_frames,
                          method="py-spy" if py_spy else "auto")
    emit(as_json, {"mesh": name, "ranks": [dataclasses.asdict(s) for s in report.stacks]}, repr(report))


@main.command("top", help=shared_help.about("top").replace(", refreshing in the cell until interrupted",
                                                            ", refreshing until interrupted (Ctrl-C)"))
@click.argument("name")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=1.0, metavar="S",
              help=shared_help.option("top", "interval"))
@click.option("--count", type=click.IntRange(min=0), default=0, metavar="N", help=shared_help.option("top", "count"))
@json_option
def top(name: str, interval: float, count: int, as_json: bool) -> None:
    procs = _detached_mesh(name, "top", as_json)
    target = find(name, as_json, ("detached",))
    assert target.record is not None
    hosts = {r: str(h or "") for r, h in zip(procs.shape.ranks, procs.ref.hosts, strict=False)}
    metrics, n = RankMetrics(), 0
    tty = sys.stdout.isatty()  # a terminal: the table redrawn in place; piped: one after another
    try:
        while True:
            got, pids = listing.usage(target.record)
            points = metrics.record(name, list(procs.shape.ranks), pids, got)
            n += 1
            if as_json:
                click.echo(emit_row(name, points, pids, hosts))
            else:
                if n > 1 and tty:
                    click.clear()
                click.echo(top_table(metrics, procs, hosts) + ("" if tty else "\n"))
            if count and n >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


def emit_row(name: str, points: dict, pids: dict, hosts: dict) -> str:
    import json

    return json.dumps({"mesh": name, "at": time.time(), "ranks": [
        {"rank": r, "host": hosts.get(r), "pid": pids.get(r), "cpu": p.cpu, "rss_mib": p.rss_mib, "gpu": p.gpu,
         "gpu_mib": p.gpu_mib} for r, p in points.items()]})


@main.command("attach", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@kernel_option
@click.argument("console_args", nargs=-1, type=click.UNPROCESSED, metavar="[CONSOLE_ARGS]...")
def attach(name: str, kernel: str | None, console_args: tuple[str, ...]) -> None:
    """a terminal console on a mesh (jupyter console; CONSOLE_ARGS are its own, e.g. --simple-prompt)"""
    from .attach import attach as run

    raise SystemExit(run(find(name, False, ("mesh",) if kernel else ("detached", "mesh"), kernel), console_args))


main.add_command(logs)
main.add_command(history_command)


# ---------------------------------------------------------------- setting up


@main.command("install")
@click.option("--user", is_flag=True, help="for this user only")
@click.option("--sys-prefix", is_flag=True, help="into this Python environment")
@click.option("--prefix", metavar="PREFIX", help="under this prefix")
def install(user: bool, sys_prefix: bool, prefix: str | None) -> None:
    """install the monarch kernelspec"""
    from ..kernel import kernelspec

    if sum([user, sys_prefix, prefix is not None]) > 1:
        raise click.UsageError("give one of --user, --sys-prefix and --prefix")
    path = kernelspec.install(user=user, prefix=sys.prefix if sys_prefix else prefix)
    click.echo(f"installed kernelspec {kernelspec.KERNEL_NAME!r} ({kernelspec.DISPLAY_NAME}) in {path}")


@main.command("settings")
@click.option("--markdown", is_flag=True, help="the README's tables of settings and constants")
def settings(markdown: bool) -> None:
    """the settings in force, each with its environment variable"""
    from ..kernel import kernelspec

    raise SystemExit(kernelspec.settings(markdown))


@main.group("key")
def key() -> None:
    """the key that workers (agent --listen) and their controllers share"""


@key.command("new")
@click.argument("path", metavar="PATH")
def key_new(path: str) -> None:
    """write a new key to PATH (mode 0600; never over an existing file)"""
    from ..kernel import kernelspec

    raise SystemExit(kernelspec.new_key(path))


# ---------------------------------------------------------------- helpers


def _ranks(target: Target) -> str:
    n = target.row.get("ranks") or 0
    return f"{n} rank{'s' if n != 1 else ''}"


def _local_pids(record, as_json: bool) -> list[int]:
    """The pids of the detached mesh's ranks on this machine, for the progress bar (none
    when no bar is drawn, or the host does not answer at once)."""
    if as_json or not sys.stderr.isatty():
        return []
    try:
        return [row["pid"] for row in listing.rank_rows(record, timeout=5) if row["pid"] and not row.get("remote")]
    except (TimeoutError, OSError):
        return []


def _through_kernel(target: Target, line: str, as_json: bool) -> str:
    from .through_kernel import run_magic

    return run_magic(target.kernel, line, 60, as_json)


def _detached_mesh(name: str, what: str, as_json: bool):
    """The running detached mesh ``name``, reached from this process (its stacks, its load)."""
    target = find(name, as_json, ("detached", "mesh"))
    if target.kind == "mesh":
        raise Failed(f"mesh {name!r} is {target.owner}'s, and only that kernel reaches it: run  %mesh {what}  "
                     f"there (monarch-kernel attach {name} opens a console on that kernel)", as_json)
    assert target.record is not None
    if target.row["state"] != "running":
        raise Failed(f"detached mesh {name!r} is gone: its host process (pid {target.record.pid}) exited", as_json)
    return listing.mesh(target.record)


def _rank_list(spec: str, n: int) -> list[int]:
    from ..runtime import RankSpecError, parse_ranks

    try:
        return parse_ranks(spec, n)
    except RankSpecError as e:
        raise click.BadParameter(str(e), param_hint="RANKS") from None
