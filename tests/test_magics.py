"""``%mesh``'s argument parsing on its own: the usage text lists every subcommand and option
the parsers know, and a mistake is a UsageError that names what to type.  No kernel, no
ranks: the parsers, and ``MeshMagics.mesh`` up to the point where it would run a command."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel import magic_args
from monarch_kernel.kernel.magic_args import COMMANDS, USAGE
from monarch_kernel.kernel.magic_args import parse as _parse
from monarch_kernel.kernel.magic_args import usage as _usage
from monarch_kernel.kernel.magics import MeshMagics, _auto_transform

pytestmark = pytest.mark.timeout(30)

# Every option of every subcommand, as a user types it (the parsers and USAGE must both know it).
OPTIONS = {
    "spawn": ["-n N", "--name NAME", "--env K=V", "--detach M", "--job ssh|slurm|NAME", "--hosts H1,H2",
              "--ssh-args 'ARGS'", "--nodes N", "--partition P", "--time T", "--account A", "--python PATH"],
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
    "restart": ["--ranks SPEC"],
    "sync": ["[path]"],
    "push": ["name=expr"],
    "pull": ["name"],
    "scatter": ["name=expr"],
    "gather": ["name"],
    "auto": ["on|off"],
    "debug": ["R", "--listen", "--host H", "off"],
    "pdb": ["attach R", "cast RANKS CMD", "continue", "--post-mortem on|off"],
}
CELL_OPTIONS = ["--ranks SPEC", "--timeout S", "--no-stream", "--group-outputs rank|order", "--profile"]


def usage_line(command: str) -> str:
    lines = [line for line in USAGE.splitlines() if line.startswith(f"%mesh {command}")]
    assert len(lines) == 1, f"USAGE has {len(lines)} lines for %mesh {command}:\n{USAGE}"
    return lines[0]


def test_the_commands_are_the_documented_ones():
    assert sorted(COMMANDS) == sorted(OPTIONS)


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_usage_shows_every_subcommand_with_its_options(command):
    line = usage_line(command)
    for option in OPTIONS[command]:
        assert option in line, f"{option!r} missing from USAGE's line for %mesh {command}: {line!r}"
    assert line == _usage(COMMANDS[command]), "USAGE and the command's own usage differ"
    assert COMMANDS[command].parser.description, f"%mesh {command} has no one-line help"


def test_usage_shows_the_cell_magic_with_its_options():
    cell = USAGE[USAGE.index("%%mesh"):]
    for option in CELL_OPTIONS:
        assert option in cell, f"{option!r} missing from USAGE's %%mesh entry"
    assert "run the cell on the ranks" in cell


def test_usage_starts_with_how_to_start():
    assert USAGE.startswith("start with  procs = %mesh spawn -n N  (N ranks); every command:\n")


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
                                                   "hosts": None, "ssh_args": None, "nodes": None, "partition": None,
                                                   "time": "01:00:00", "account": None, "python": None}
    a = _parse(COMMANDS["spawn"], "--job ssh --hosts a,b -n 2 --ssh-args '-i k'")
    assert (a.job, a.hosts, a.n, a.ssh_args) == ("ssh", "a,b", 2, "'-i k'")
    assert _parse(COMMANDS["stop"], "").name is None and _parse(COMMANDS["stop"], "m").name == "m"
    assert _parse(COMMANDS["push"], "a=1 b=x+1").pairs == ["a=1", "b=x+1"]
    assert _parse(COMMANDS["auto"], "off").state == "off"
    assert _parse(COMMANDS["restart"], "--ranks 0-2").ranks == "0-2"
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


def test_no_command_shows_the_usage(mesh):
    with pytest.raises(UsageError) as info:
        mesh("")
    assert str(info.value) == USAGE


def test_an_unknown_command_says_so_and_shows_the_usage(mesh):
    with pytest.raises(UsageError) as info:
        mesh("frobnicate -n 2")
    assert str(info.value) == f"%mesh frobnicate: unknown command.\n{USAGE}"


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
