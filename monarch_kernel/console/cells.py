"""Compiling a ``%%mesh`` cell on a rank: one code object for the whole cell, under the file
name the kernel gives it, with line numbers that match the cell as the user sees it.

A cell that is plain Python compiles as it is; one that is not (``!ls``, ``%time``, ``x?``)
goes through IPython's input transformers first, as an IPython cell would.  Pure: it
compiles and executes nothing itself.
"""

from __future__ import annotations

import ast
import linecache
import types
from collections.abc import Callable

LAST = "__mesh_last_value__"  # holds a cell's last expression for a moment


def compile_cell(code: str, filename: str, line_offset: int = 0,
                 transform: Callable[[str], str] | None = None,
                 magic_line: bool = False) -> tuple[types.CodeType, bool]:
    """``(code object, shows)``; ``shows``: the cell ends in an expression whose value is
    left in ``LAST`` of the namespace it runs in, as IPython shows a cell's last value.

    ``transform`` (IPython's ``transform_cell``) is tried only when ``code`` is not Python,
    so a plain cell costs nothing more, or when ``magic_line`` says IPython reads it as a
    magic though it parses (``cd /tmp``).  One code object, so a debugger steps onto the
    last line too.  Raises SyntaxError.
    """
    before = "\n" * line_offset  # numbered as in the whole cell, syntax errors too
    python = _ipython(code, transform) if magic_line and transform is not None else None
    if python is None:
        try:
            tree = _parse(before + code, filename)
        except SyntaxError:
            python = _ipython(code, transform) if transform is not None else None
            if python is None:
                raise
    if python is not None:
        code = python
        tree = _parse(before + python, filename)
    last = tree.body[-1] if tree.body else None
    shows = False
    if isinstance(last, ast.Expr) and not _ends_in_semicolon(code, last, line_offset):
        shows = True
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(LAST, ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec"), shows


def _ipython(code: str, transform: Callable[[str], str]) -> str | None:
    """``code`` as Python by IPython's rules, on the same lines; None if that changes nothing."""
    lines = code.splitlines(True)
    blank = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    rest = "".join(lines[blank:])  # IPython drops leading blank lines: they keep their numbers here
    python = transform(rest)
    return None if python.rstrip("\n") == rest.rstrip("\n") else "\n" * blank + python


def _parse(code: str, filename: str) -> ast.Module:
    # compile() itself rather than ast.parse: a syntax error's traceback then has no frame
    # of ast.py, only the cell's line.
    tree = compile(code, filename, "exec", ast.PyCF_ONLY_AST)
    assert isinstance(tree, ast.Module)
    return tree


def _ends_in_semicolon(code: str, last: ast.stmt, line_offset: int) -> bool:
    """``x;`` as a cell's last line: IPython's way to run it without showing its value."""
    end = last.end_lineno - line_offset - 1 if last.end_lineno is not None else -1
    lines = code.splitlines()
    if not 0 <= end < len(lines):
        return False
    after = lines[end].encode()[last.end_col_offset or 0:]  # ast's columns count UTF-8 bytes
    return after.lstrip().startswith(b";")


def remember_source(filename: str, cell: str) -> None:
    """Let tracebacks and debuggers on this rank quote the cell's lines."""
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
