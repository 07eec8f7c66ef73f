"""Compiling a ``%%mesh`` cell on a rank: one code object for the whole cell, under the file
name the kernel gives it, with line numbers that match the cell as the user sees it.

Pure: it compiles and executes nothing itself.
"""

from __future__ import annotations

import ast
import linecache
import types

LAST = "__mesh_last_value__"  # holds a cell's last expression for a moment


def compile_cell(code: str, filename: str, line_offset: int = 0) -> tuple[types.CodeType, bool]:
    """``(code object, shows)``; ``shows``: the cell ends in an expression whose value is
    left in ``LAST`` of the namespace it runs in, as IPython shows a cell's last value.

    One code object, so a debugger steps onto the last line too.  Raises SyntaxError.
    """
    tree = ast.parse(code, filename, "exec")
    ast.increment_lineno(tree, line_offset)
    last = tree.body[-1] if tree.body else None
    shows = isinstance(last, ast.Expr)
    if isinstance(last, ast.Expr):
        tree.body[-1] = ast.copy_location(ast.Assign([ast.Name(LAST, ast.Store())], last.value), last)
        ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec"), shows


def remember_source(filename: str, cell: str) -> None:
    """Let tracebacks and debuggers on this rank quote the cell's lines."""
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
