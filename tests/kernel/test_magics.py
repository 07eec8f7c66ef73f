"""``%mesh``'s argument parsing and help on their own: the list has a line for every
subcommand, each subcommand's full help every option its parser knows, and a mistake is a
UsageError that names what to type (the nearest subcommand, for a typo).  No kernel, no ranks:
the parsers, and ``MeshMagics.mesh`` up to the point where it would run a command."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel import magic_args
from monarch_kernel.kernel.magic_args import CELL, COMMANDS, USAGE, full_help, summary
from monarch_kernel.kernel.magic_args import parse as _parse
from monarch_kernel.kernel.magic_args import usage as _usage
from monarch_kernel.kernel.magics import MeshMagics, _auto_transform

pytestmark = pytest.mark.timeout(30)

# Every option of every subcommand, as a user types it (the parsers and the help must both know it).
OPTIONS = {
    "spawn": ["-n N", "--name NAME", "--env K=V", "--detach M", "--job ssh|slurm|NAME", "--hosts H1,H2",
              "--ssh-args 'ARGS'", "--out-of-cluster [yes|no|auto]",
              "--nodes N", "--partition P", "--time T", "--account A", "--login USER@HOST", "--python PATH",
              "--restart on-failure|never", "--max-restarts N", "--restart-window S"],
    "jobs": [],
    "run": ["SCRIPT [ARGS]", "-m MODULE [ARGS]"],
    "kill-job": ["[name]"],
    "attach": ["name"],
    "list": [],
    "tensors": [],
    "use": ["name"],
    "stop": ["[name]"],
    "status": ["--all"],
    "stacks": ["[RANKS]", "--native", "--all-threads", "--runtime-frames", "--py-spy"],
    "watchdog": ["SECONDS|off"],
    "collectives": [],
    "top": ["--interval S", "--count N"],
    "history": ['"SQL"', "--mesh M", "--plot METRIC", "--list", "--views", "--root DIR"],
    "restart": ["--ranks SPEC"],
    "policy": ["[name]", "--restart on-failure|never", "--max-restarts N", "--restart-window S"],
    "sync": ["[path]"],
    "push": ["name=expr"],
    "pull": ["name"],
    "scatter": ["name=expr"],
    "gather": ["name"],
    "auto": ["on|off"],
    "debug": ["R", "--listen", "--host H", "off"],
    "pdb": ["attach R", "cast RANKS CMD", "continue", "--post-mortem on|off"],
    "help": ["[SUBCOMMAND]"],
}
CELL_OPTIONS = ["--ranks SPEC", "--timeout S", "--no-stream", "--group-outputs rank|order", "--profile"]


def test_the_commands_are_the_documented_ones():
    assert sorted(COMMANDS) == sorted(OPTIONS)


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_the_list_has_a_line_for_every_subcommand(command):
    lines = [line for line in USAGE.splitlines() if line.startswith(f"  {command} ")]
    assert len(lines) == 1, f"the list has {len(lines)} lines for %mesh {command}:\n{USAGE}"
    assert lines[0].split(None, 1)[1] == summary(COMMANDS[command]), "the list and the docstring differ"
    assert summary(COMMANDS[command]), f"%mesh {command} has no one-line help"


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_full_help_shows_the_usage_and_every_option(command):
    text = full_help(command)
    first = text.splitlines()[0].strip()
    assert first.startswith(f"%mesh {command}"), text
    usage_text = " ".join(text[:text.index("\n\n")].split())
    assert usage_text == _usage(COMMANDS[command]), "the full help and the command's own usage differ"
    for option in OPTIONS[command]:
        assert option in usage_text, f"{option!r} missing from the usage of %mesh {command}: {usage_text!r}"
    assert summary(COMMANDS[command]) in text


def test_the_cell_magic_has_its_line_and_full_help():
    assert _usage(magic_args.cell_args) in USAGE.splitlines()
    assert summary(magic_args.cell_args) == "run the cell on the ranks, each in its own persistent namespace"
    text = full_help(CELL)
    for option in CELL_OPTIONS:
        assert option in text, f"{option!r} missing from the %%mesh help"


def test_the_list_starts_with_how_to_start_and_ends_with_where_more_help_is():
    lines = USAGE.splitlines()
    assert lines[0] == "%mesh SUBCOMMAND [ARGS]: drive meshes of ranks; start with  procs = %mesh spawn -n 4"
    assert lines[-1] == "%mesh help SUBCOMMAND (or %mesh SUBCOMMAND --help): its arguments and options"


def test_the_magic_docstring_is_the_list():
    assert MeshMagics.mesh.__doc__ == USAGE  # what %mesh? shows


@pytest.mark.parametrize("command, line, says", [
    ("spawn", "-n four", "-n takes a number: %mesh spawn -n 4"),
    ("spawn", "-n 0", "-n must be at least 1: %mesh spawn -n 4"),
    ("spawn", "--env X", "--env takes NAME=VALUE: %mesh spawn -n 4 --env OMP_NUM_THREADS=1"),
    # One rule for every mesh name (monarch_kernel/actor/spawn_checks.py): files are named after them.
    ("spawn", "--detach a/b", "'a/b' cannot name a mesh: files are named after it, so it takes 1 to 64 ASCII "
                              "letters, digits, '_', '.' and '-', and starts with a letter, a digit or '_': "
                              "%mesh spawn -n 4 --detach trainers"),
    ("spawn", "--name .hidden", "'.hidden' cannot name a mesh"),
    ("spawn", "--name a:b", "'a:b' cannot name a mesh"),
    ("attach", "../x", "'../x' cannot name a mesh"),
    ("spawn", "--bogus", "unrecognized arguments: --bogus"),
    ("attach", "", "the following arguments are required: name"),
    ("spawn", "--job ssh --out-of-cluster maybe", "argument --out-of-cluster: invalid choice: 'maybe'"),
    ("use", "a b", "unrecognized arguments: b"),
    ("push", "", "the following arguments are required: name=expr"),
    ("auto", "maybe", "invalid choice: 'maybe'"),
    ("restart", "--ranks", "expected one argument"),
    ("status", "now", "unrecognized arguments: now"),
    ("sync", "a b", "unrecognized arguments: b"),
])
def test_a_bad_argument_names_the_commands_usage(command, line, says):
    fn = COMMANDS[command]
    with pytest.raises(UsageError) as info:
        _parse(fn, line)
    message = str(info.value)
    assert says in message
    assert message.endswith(f"; type  {_usage(fn)}"), message


@pytest.mark.parametrize("line, says", [
    ("--group-outputs x", "invalid choice: 'x'"),
    ("--timeout soon", "invalid float value: 'soon'"),
])
def test_a_bad_cell_argument_names_the_cell_usage(line, says):
    with pytest.raises(UsageError) as info:
        _parse(magic_args.cell_args, line)
    assert says in str(info.value)
    assert str(info.value).endswith(f"; type  {_usage(magic_args.cell_args)}")


def test_arguments_parse_to_their_values():
    a = _parse(COMMANDS["spawn"], "-n 3 --env A=1 --env B= --env C=x=y --detach t-1")
    assert (a.n, a.name, a.env, a.detach) == (3, None, [("A", "1"), ("B", ""), ("C", "x=y")], "t-1")
    assert _parse(COMMANDS["spawn"], "--name 9lives.v2").name == "9lives.v2"  # what spawn_procs(name=) takes
    assert vars(_parse(COMMANDS["spawn"], "")) == {"n": 1, "name": None, "env": [], "detach": None, "job": None,
                                                   "hosts": None, "ssh_args": None, "out_of_cluster": None,
                                                   "nodes": None, "partition": None,
                                                   "time": "01:00:00", "account": None, "login": None,
                                                   "python": None,
                                                   "sync_env": False, "attach": None, "key_file": None,
                                                   "restart": None, "max_restarts": 3, "restart_window": 600.0}
    a = _parse(COMMANDS["spawn"], "--job ssh --hosts a,b -n 2 --ssh-args '-i k'")
    assert (a.job, a.hosts, a.n, a.ssh_args) == ("ssh", "a,b", 2, "'-i k'")
    assert [_parse(COMMANDS["spawn"], f"--job ssh --hosts a {flag}").out_of_cluster
            for flag in ("--out-of-cluster", "--out-of-cluster no", "--out-of-cluster auto", "")] \
        == ["yes", "no", "auto", None]
    assert _parse(COMMANDS["stop"], "").name is None and _parse(COMMANDS["stop"], "m").name == "m"
    assert _parse(COMMANDS["push"], "a=1 b=x+1").pairs == ["a=1", "b=x+1"]
    assert _parse(COMMANDS["auto"], "off").state == "off"
    assert _parse(COMMANDS["restart"], "--ranks 0-2").ranks == "0-2"
    a = _parse(COMMANDS["policy"], "m --restart on-failure --max-restarts -1 --restart-window 60")
    assert (a.name, a.restart, a.max_restarts, a.restart_window) == ("m", "on-failure", -1, 60.0)
    # debug and pdb keep their words for their own grammar (in debug/)
    assert _parse(COMMANDS["debug"], "1 --listen --host 0.0.0.0").words == ["1", "--listen", "--host", "0.0.0.0"]
    assert _parse(COMMANDS["pdb"], "cast 0-1 p x").words == ["cast", "0-1", "p", "x"]
    cell = _parse(magic_args.cell_args, "")
    assert vars(cell) == {"ranks": None, "timeout": None, "no_stream": False, "group_outputs": "order",
                          "profile": False}
    cell = _parse(magic_args.cell_args, "--ranks ::2 --timeout 2.5 --no-stream --group-outputs rank")
    assert (cell.ranks, cell.timeout, cell.no_stream, cell.group_outputs) == ("::2", 2.5, True, "rank")


@pytest.fixture
def mesh():
    """``%mesh`` of a MeshMagics that has no shell or session: only what happens before a
    command runs can be called."""
    return MeshMagics.__new__(MeshMagics).mesh


@pytest.mark.parametrize("line", ["", "  ", "--help", "-h"])
def test_no_command_prints_the_list_without_an_error(mesh, capsys, line):
    assert mesh(line) is None
    assert capsys.readouterr().out == USAGE + "\n"


@pytest.mark.parametrize("line, name", [
    ("spawn --help", "spawn"), ("stop -h", "stop"), ("push x=1 --help", "push"), ("run --help", "run"),
    ("debug -h", "debug"), ("pdb --help", "pdb"), ("help --help", "help"),
])
def test_help_after_a_subcommand_prints_its_full_help(mesh, capsys, line, name):
    assert mesh(line) is None
    assert capsys.readouterr().out == full_help(name) + "\n"


@pytest.mark.parametrize("line, shows", [("help", USAGE), ("help spawn", full_help("spawn")),
                                         ("help kill-job", full_help("kill-job")), ("help %%mesh", full_help(CELL))])
def test_help_prints_the_list_or_one_subcommand_in_full(mesh, capsys, line, shows):
    assert mesh(line) is None
    assert capsys.readouterr().out == shows + "\n"


def test_help_of_an_unknown_subcommand_suggests_the_nearest(mesh):
    with pytest.raises(UsageError, match=r"^%mesh help spwan: no such subcommand; did you mean  %mesh help spawn$"):
        mesh("help spwan")
    with pytest.raises(UsageError, match=r"^%mesh help zzz: no such subcommand; %mesh help lists them all$"):
        mesh("help zzz")


def test_cell_help_prints_the_cell_magics_help_and_runs_nothing(mesh, capsys):
    assert mesh("--help", "1/0") is None
    assert capsys.readouterr().out == full_help(CELL) + "\n"


@pytest.mark.parametrize("typed, meant", [("spwan", "spawn"), ("stpo", "stop"), ("stack", "stacks"),
                                          ("hlep", "help"), ("kill_job", "kill-job")])
def test_a_mistyped_command_suggests_the_nearest(mesh, typed, meant):
    with pytest.raises(UsageError) as info:
        mesh(f"{typed} -n 2")
    assert str(info.value) == (f"%mesh {typed}: unknown command; did you mean  %mesh {meant} -n 2  "
                               "(%mesh help lists every command)")


def test_an_unknown_command_names_every_command(mesh):
    with pytest.raises(UsageError) as info:
        mesh("frobnicate -n 2")
    assert str(info.value) == (f"%mesh frobnicate: unknown command; the commands: {', '.join(COMMANDS)} "
                               "(%mesh help: a line on each)")


def test_unbalanced_quotes_are_a_usage_error(mesh):
    with pytest.raises(UsageError, match="^%mesh push: No closing quotation$"):
        mesh('push x="a')


def test_a_bad_subcommand_argument_reaches_the_user_with_its_usage(mesh):
    with pytest.raises(UsageError) as info:
        mesh("spawn -n four")
    assert str(info.value) == ("argument -n: -n takes a number: %mesh spawn -n 4; "
                               f"type  {_usage(COMMANDS['spawn'])}")


def test_grouping_by_rank_needs_no_stream(mesh):
    with pytest.raises(UsageError, match="^--group-outputs rank needs the whole output first: add --no-stream$"):
        mesh("--group-outputs rank", "1")


@pytest.mark.parametrize("lines, expect", [
    (["x = 1\n", "x\n"], ["%%mesh\n", "x = 1\n", "x\n"]),
    (["%mesh status\n"], ["%mesh status\n"]),
    (["  %%mesh --ranks 0\n", "1\n"], ["  %%mesh --ranks 0\n", "1\n"]),
    (["\n", "   \n"], ["\n", "   \n"]),
    ([], []),
])
def test_auto_mode_sends_plain_cells_to_the_mesh(lines, expect):
    assert _auto_transform(lines) == expect
