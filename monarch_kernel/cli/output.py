"""How the command line answers: exit codes a script can test (0 ok, 1 failed, 2 bad usage,
3 not found), one JSON document with ``--json``, and aligned tables (a bold header on a
terminal, plain text when piped).  It prints; it never decides what to do.
"""

from __future__ import annotations

import json
import sys

import click

OK, FAILED, USAGE, NOT_FOUND = 0, 1, 2, 3


class Failed(click.ClickException):
    """What was asked could not be done (exit 1); the message says why and what to type."""

    exit_code = FAILED

    def __init__(self, message: str, as_json: bool = False):
        super().__init__(message)
        self.as_json = as_json

    def show(self, file=None) -> None:
        if self.as_json:
            click.echo(json.dumps({"error": self.message, "exit_code": self.exit_code}))
        click.echo(f"monarch-kernel: {self.message}", err=True)


class NotFound(Failed):
    """No mesh, job or history of that name (exit 3)."""

    exit_code = NOT_FOUND


class Ambiguous(Failed):
    """A NAME that more than one thing holds, where the command must act on one (exit 2)."""

    exit_code = USAGE


json_option = click.option("--json", "as_json", is_flag=True, help="one JSON document on stdout, for scripts")


def emit(as_json: bool, data, text: str) -> None:
    """``data`` as JSON with ``--json``, else ``text``."""
    click.echo(json.dumps(data, default=str) if as_json else text)


def table(rows: list[dict], columns: list[str]) -> str:
    """``rows`` as aligned columns under a header (bold on a terminal)."""
    cells = [[str(_cell(row.get(c))) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    head = "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()
    if sys.stdout.isatty():
        head = click.style(head, bold=True)
    return "\n".join([head, *("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                              for r in cells)])


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)
