"""The ``%mesh`` subcommands' arguments and help, declared once with IPython's
``magic_arguments``: each subcommand is only a parser, whose docstring's first line is its line
in the list (``%mesh``, ``%mesh help``, ``%mesh?``) and whose whole help (usage, docstring,
options) is what ``%mesh help SUB`` and ``%mesh SUB --help`` print, so the help and the
parsing cannot drift apart.  ``MeshMagics`` (``magics.py``) runs them.  Runs in the kernel.
"""

from __future__ import annotations

import argparse
import difflib

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..actor.spawn_checks import mesh_name_problem


def _count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("-n takes a number: %mesh spawn -n 4") from None
    if n < 1:
        raise argparse.ArgumentTypeError("-n must be at least 1: %mesh spawn -n 4")
    return n


def _name(value: str) -> str:
    problem = mesh_name_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}: %mesh spawn -n 4 --detach trainers")
    return value


def _restarts(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -2
    if n < -1:
        raise argparse.ArgumentTypeError("--max-restarts takes a count, or -1 for no limit: "
                                         "%mesh spawn -n 4 --restart on-failure --max-restarts 3")
    return n


def _window(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = 0.0
    if not s > 0:
        raise argparse.ArgumentTypeError("--restart-window takes seconds (over 0): "
                                         "%mesh spawn -n 4 --restart on-failure --restart-window 600")
    return s


def restart_options(fn):
    """The restart policy's options, shared by ``%mesh spawn`` and ``%mesh policy``."""
    fn = argument("--restart-window", type=_window, default=600.0, metavar="S",
                  help="the window --max-restarts counts deaths in, in seconds (default 600)")(fn)
    fn = argument("--max-restarts", type=_restarts, default=3, metavar="N",
                  help="deaths replaced within the window before the mesh fails as a crash loop (default 3; "
                       "-1: no limit), after Ray's max_restarts")(fn)
    return argument("--restart", choices=("never", "on-failure"), default=None, metavar="on-failure|never",
                    help="on-failure: a rank that dies is replaced by itself, with its actors and a fresh "
                         "namespace (default: never)")(fn)


def _env(value: str) -> tuple[str, str]:
    k, eq, v = value.partition("=")
    if not eq or not k:
        raise argparse.ArgumentTypeError("--env takes NAME=VALUE: %mesh spawn -n 4 --env OMP_NUM_THREADS=1")
    return k, v


@magic_arguments(name="mesh spawn")
@argument("-n", type=_count, default=1, metavar="N", help="ranks to start")
@argument("--name", type=_name, help="the mesh's name (default: the variable it is assigned to, else procs); "
          "a name spawned again reuses its mesh if the options match, else stops and replaces it")
@argument("--env", type=_env, action="append", default=[], metavar="K=V", help="an environment variable for the ranks")
@argument("--detach", type=_name, metavar="M", help="keep the ranks running after the kernel ends, as mesh M")
@argument("--job", metavar="ssh|slurm|NAME", help="start the ranks on other hosts: a new ssh or slurm job, or a "
          "running job's name (%%mesh jobs); -n is then ranks per host")
@argument("--hosts", metavar="H1,H2", help="--job ssh: the hosts, as ssh reaches them")
@argument("--ssh-args", metavar="'ARGS'", help="--job ssh (or slurm --login): ssh's options, quoted as one, e.g. "
          "'-i key -l me'")
@argument("--out-of-cluster", nargs="?", const="yes", choices=("yes", "no", "auto"), metavar="yes|no|auto",
          help="--job ssh (or slurm --login): the hosts reach this kernel through the ssh connections that start "
          "their agents (or the login node's): yes "
          "(the flag alone), no (never), auto (the default: hosts that cannot reach it within reach_timeout)")
@argument("--nodes", type=_count, metavar="N", help="--job slurm: nodes to allocate")
@argument("--partition", metavar="P", help="--job slurm: the partition")
@argument("--time", metavar="T", default="01:00:00", help="--job slurm: the time limit (default 01:00:00)")
@argument("--account", metavar="A", help="--job slurm: the account")
@argument("--login", metavar="USER@HOST", help="--job slurm from outside the cluster: run Slurm's commands on this "
          "login node over ssh; the mesh's connections pass through it (this kernel opens no network port)")
@argument("--python", metavar="PATH", help="--job: the interpreter on the hosts (default: this kernel's; "
          "with --sync-env, python3)")
@argument("--sync-env", action="store_true", help="--job: first send this kernel's Python environment to hosts "
          "that lack it (cached there; a second job sends only what changed)")
@argument("--attach", metavar="tcp://H:P,...", help="start the ranks on workers that a scheduler started (python -m "
          "monarch_kernel.agent --listen tcp://0.0.0.0:P --key-file PATH); -n is then ranks per worker")
@argument("--key-file", metavar="PATH", help="--attach: the workers' key file (python -m monarch_kernel key new PATH)")
@restart_options
def _spawn():
    """start N ranks (returns the ProcMesh; it becomes current)

    Each rank has a persistent namespace that %%mesh cells run in.  Examples:
      procs = %mesh spawn -n 4
      procs = %mesh spawn -n 4 --detach trainers      (outlives the kernel; %mesh attach trainers)
      procs = %mesh spawn -n 4 --restart on-failure   (a dead rank is replaced by itself)
      procs = %mesh spawn --job slurm --nodes 2 -n 4  (4 ranks on each of 2 nodes)
      procs = %mesh spawn --job slurm --nodes 2 --login me@cluster  (from a laptop)
      procs = %mesh spawn --attach tcp://node1:29500,tcp://node2:29500 --key-file ~/.mk-key -n 4
    """


@magic_arguments(name="mesh attach")
@argument("name", type=_name, help="the name given to --detach")
def _attach():
    """reconnect to a detached mesh (after a kernel restart)"""


@magic_arguments(name="mesh list")
def _list():
    """the meshes, and detached ones not attached here"""


@magic_arguments(name="mesh tensors")
def _tensors():
    """the live distributed tensors of each mesh, by the variable that holds each; the rest counted

    Each tensor a notebook variable holds is named by it (w, model.weight, losses[3],
    model.weight.grad); the others (intermediate results, autograd's saved tensors, an
    optimizer's state) are counted together: 22 scalar temporaries, 88 bytes per rank.
    """


@magic_arguments(name="mesh use")
@argument("name")
def _use():
    """make mesh NAME current"""


@magic_arguments(name="mesh stop")
@argument("name", nargs="?")
def _stop():
    """end a mesh (the current one by default)"""


@magic_arguments(name="mesh jobs")
def _jobs():
    """list the jobs (ssh, slurm, attach) this kernel started, their hosts and meshes"""


@magic_arguments(name="mesh kill-job")
@argument("name", nargs="?", help="the job (default: the only one)")
def _kill_job():
    """end a job: stop its meshes, its agents, and free its hosts (scancel for slurm; attached workers exit)"""


@magic_arguments(name="mesh status")
@argument("--all", action="store_true", help="every rank, also of a large mesh (otherwise summarised)")
def _status():
    """each rank's pid, state, memory and last line"""


@magic_arguments(name="mesh restart")
@argument("--ranks", metavar="SPEC", help="which dead ranks (default: every dead or not responding rank)")
def _restart():
    """replace dead ranks (same numbers, fresh namespaces)"""


@magic_arguments(name="mesh policy")
@argument("name", nargs="?", help="the mesh (default: the current one)")
@restart_options
def _policy():
    """show or change a mesh's restart policy, and list its restarts

    Examples:
      %mesh policy                          (the policy, and every restart so far)
      %mesh policy --restart on-failure     (replace dead ranks by themselves from now on)
      %mesh policy --restart never
    """


@magic_arguments(name="mesh stacks")
@argument("ranks", nargs="?", metavar="RANKS", help="which ranks, like 0-3,5 (default: all)")
@argument("--native", action="store_true", help="C frames too (py-spy --native)")
@argument("--all-threads", action="store_true", help="also threads that run no user code")
@argument("--runtime-frames", action="store_true", help="keep monarch_kernel's own frames")
@argument("--py-spy", action="store_true", help="read every rank from outside (by default only those that "
          "do not dump their own stacks at once)")
def _stacks():
    """every rank's thread stacks, ranks with the same stacks grouped (py-spy reads ranks that cannot answer)"""


@magic_arguments(name="mesh top")
@argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default 1)")
@argument("--count", type=int, default=0, metavar="N", help="stop after N refreshes (default: until interrupted)")
def _top():
    """each rank's CPU and memory, with sparklines, refreshing in the cell until interrupted"""


@magic_arguments(name="mesh history")
@argument("query", nargs="*", metavar='"SQL"', help="a query over the views lines, events, metrics, samples, "
          "stacks (DuckDB's SQL), best quoted as one; the answer is a pandas DataFrame")
@argument("--mesh", metavar="M", help="whose history (default: the current mesh's, else the latest written)")
@argument("--run", metavar="RUN", help="which run (one spawn) of it: an id of --list, or its start; 'all': every "
          "run, with a run column (default: the latest, in a kernel the one it spawned)")
@argument("--plot", metavar="METRIC", help="draw each rank's METRIC (monarch_kernel.metric) over steps")
@argument("--list", action="store_true", help="the histories on disk, one row per run of a mesh or job: hosts, "
          "times, state")
@argument("--views", action="store_true", help="the views and their columns")
@argument("--root", metavar="DIR", help="where histories live (default: the history_dir setting)")
def _history():
    """the run's history on disk (every rank's lines, events, metrics, samples, stacks), asked in SQL

      %mesh history "SELECT rank, count(*) FROM lines GROUP BY rank"
      %mesh history "SELECT * FROM events WHERE kind = 'exit'"
      %mesh history --plot loss
      %mesh history --run all "SELECT run, count(*) FROM lines GROUP BY run"
    """


@magic_arguments(name="mesh collectives")
def _collectives():
    """where each rank is in its process groups' collectives, and which ranks hold the others up"""


@magic_arguments(name="mesh watchdog")
@argument("seconds", metavar="SECONDS|off", help="after how long without progress a cell's wait on ranks is a hang")
@argument("--then", default="dump", metavar="dump|abort|restart",
          help="dump: show and save the ranks' stacks and collectives (default); abort: also tear the hung work "
               "down and raise HangError in the cell; restart: also kill the stuck ranks and replace them "
               "(needs %%mesh policy --restart on-failure)")
def _watchdog():
    """report a hang once when the ranks a cell waits on make no progress that long (off by default)"""


@magic_arguments(name="mesh sync")
@argument("path", nargs="?", help="the folder (default: the kernel's working directory)")
def _sync():
    """send a folder's changed files to the ranks' hosts and re-import them there"""


@magic_arguments(name="mesh push")
@argument("pairs", nargs="+", metavar="name=expr")
def _push():
    """set names on every rank"""


@magic_arguments(name="mesh pull")
@argument("name")
def _pull():
    """a ValueMesh of name from every rank"""


@magic_arguments(name="mesh scatter")
@argument("pair", metavar="name=expr")
def _scatter():
    """split a list/array/tensor across the ranks"""


@magic_arguments(name="mesh gather")
@argument("name")
def _gather():
    """join name's pieces from every rank"""


@magic_arguments(name="mesh auto")
@argument("state", choices=["on", "off"], metavar="on|off")
def _auto():
    """run every following cell on the mesh"""


@magic_arguments(name="mesh debug")
@argument("words", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
def _debug():
    """JupyterLab's debugger on rank R (--listen: a VS Code attach config instead)

      %mesh debug R                  JupyterLab's debugger (the bug icon) debugs rank R
      %mesh debug R --listen [--host H]
                                     print a VS Code (any DAP client) attach config for rank R
      %mesh debug off                the debugger debugs the kernel itself again
      %mesh debug                    which one it debugs now
    """


@magic_arguments(name="mesh pdb")
@argument("words", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
def _pdb():
    """ranks stopped in breakpoint(), and talking to them

      %mesh pdb                      the ranks stopped in pdb, and where
      %mesh pdb attach R             talk to rank R's pdb here
      %mesh pdb cast RANKS CMD       send one pdb command to several ranks, e.g. %mesh pdb cast 0-3 p x
      %mesh pdb continue             let every stopped rank go on
      %mesh pdb --post-mortem on|off stop a rank in pdb where a %%mesh cell raises
    """


@magic_arguments(name="mesh run")
@argument("words", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
def _run():
    """run a torchrun script on every rank of the current mesh (warm ranks: no process start)

    The ranks get torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and a fresh
    rendezvous port; the arguments after the script are its own (its --help too).  Examples:
      %mesh run train.py --lr 0.1
      %mesh run -m package.train --lr 0.1
    """


@magic_arguments(name="%mesh")
@argument("--ranks", metavar="SPEC", help="which ranks: 0 | 0-3 | 0,2 | ::2 (default: all)")
@argument("--timeout", type=float, metavar="S", help="stop waiting after S seconds (the ranks run on)")
@argument("--no-stream", action="store_true", help="hold the output until the cell ends")
@argument("--group-outputs", choices=["rank", "order"], default="order", metavar="rank|order",
          help="with --no-stream, rank: each rank's lines together (default order: as printed)")
@argument("--profile", action="store_true", help="torch.profiler on every rank for the cell: top ops, slowest "
          "ranks, steps, and one merged trace file")
def cell_args():
    """run the cell on the ranks, each in its own persistent namespace

    The cell is an IPython cell on each rank.  Lines printed by several ranks show once,
    as [ranks 0-3] line; a failure that is the same on several ranks shows once too.
    The stop button interrupts the ranks' code and keeps their namespaces.
    """


@magic_arguments(name="mesh help")
@argument("subcommand", nargs="?", metavar="SUBCOMMAND", help="one subcommand (or %%%%mesh) in full")
def _help():
    """this list, or one subcommand in full"""


COMMANDS = {"spawn": _spawn, "attach": _attach, "list": _list, "tensors": _tensors, "use": _use, "stop": _stop,
            "status": _status, "stacks": _stacks, "top": _top, "collectives": _collectives, "watchdog": _watchdog,
            "history": _history, "restart": _restart, "policy": _policy, "sync": _sync,
            "push": _push, "pull": _pull,
            "scatter": _scatter, "gather": _gather, "auto": _auto, "debug": _debug, "pdb": _pdb,
            "jobs": _jobs, "kill-job": _kill_job, "run": _run, "help": _help}
CELL = "%%mesh"  # %mesh help %%mesh: the cell magic's help


_debug.parser.usage = "%(prog)s R [--listen [--host H]] | off"
_pdb.parser.usage = "%(prog)s [attach R | cast RANKS CMD | continue | --post-mortem on|off]"
_run.parser.usage = "%(prog)s SCRIPT [ARGS] | -m MODULE [ARGS]"


def usage(fn) -> str:
    """One line (argparse wraps long ones)."""
    return " ".join(fn.parser.format_usage().replace("::", "").replace("usage:", "").split())


def summary(fn) -> str:
    """The first line of a subcommand's docstring: its line in the list."""
    return (fn.parser.description or "").strip().splitlines()[0]


def full_help(name: str) -> str:
    """``%mesh help NAME``: the usage, the whole docstring and every option of subcommand
    ``NAME`` (or of the ``%%mesh`` cell magic)."""
    fn = cell_args if name == CELL else COMMANDS[name]
    return fn.parser.format_help().removeprefix("::\n\n").strip("\n")


def nearest(word: str) -> str | None:
    """The subcommand closest to a mistyped ``word`` (``spwan`` -> ``spawn``), if one is close."""
    close = difflib.get_close_matches(word, [*COMMANDS, CELL], n=1, cutoff=0.6)
    return close[0] if close else None


def _listing() -> str:
    width = max(map(len, COMMANDS)) + 2
    rows = [f"  {name:<{width}}{summary(fn)}" for name, fn in COMMANDS.items()]
    return "\n".join([
        "%mesh SUBCOMMAND [ARGS]: drive meshes of ranks; start with  procs = %mesh spawn -n 4",
        *rows,
        f"{usage(cell_args)}",
        f"  {'':<{width}}{summary(cell_args)}",
        "%mesh help SUBCOMMAND (or %mesh SUBCOMMAND --help): its arguments and options",
    ])


#: Every subcommand with a line each: what ``%mesh``, ``%mesh help`` and ``%mesh?`` show.
USAGE = _listing()


def parse(fn, argstring: str):
    """``parse_argstring``, with the usage of that command added to a mistake's message."""
    try:
        return parse_argstring(fn, argstring)
    except UsageError as e:
        raise UsageError(f"{e}; type  {usage(fn)}") from None
