"""The ``%mesh`` subcommands' help, for the command line's subcommands that mean the same
thing (``stacks``, ``top``, ``kill-job``): read from the magics' own parsers
(``kernel/magic_args.py``), so the notebook and the terminal cannot say different things.
"""

from __future__ import annotations

from ..kernel import magic_args


def about(command: str) -> str:
    """The first line of ``%mesh COMMAND``'s help."""
    return magic_args.summary(magic_args.COMMANDS[command])


def option(command: str, dest: str) -> str:
    """The help of ``%mesh COMMAND``'s argument or option whose destination is ``dest``."""
    for action in magic_args.COMMANDS[command].parser._actions:  # argparse's own list of them
        if action.dest == dest:
            return str(action.help or "")
    raise KeyError(f"%mesh {command} has no option {dest!r}")
