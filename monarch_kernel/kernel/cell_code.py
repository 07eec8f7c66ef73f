"""Code defined in notebook cells keeps its cell's file name when it travels to a rank.

cloudpickle (3.x) renames every by-value code object to ``<dynamic-code>``, so on a rank
neither pdb nor debugpy could tell which cell a notebook-defined function came from: no
source lines, and breakpoints set in the cell would never match.  The kernel puts the
cell's name back for code compiled from cells (ipykernel's temp-file names) and only then.
"""

from __future__ import annotations

import os
import types

_installed = False


def keep_cell_filenames() -> None:
    """Patch cloudpickle's code reducer in this (the controller's) process, once."""
    global _installed
    if _installed:
        return
    import cloudpickle
    from ipykernel.compiler import get_tmp_directory

    table = cloudpickle.Pickler._dispatch_table
    original = table[types.CodeType]
    prefix = get_tmp_directory() + os.sep

    def code_reduce(code: types.CodeType):
        rebuild, args = original(code)
        if code.co_filename.startswith(prefix):
            args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
        return rebuild, args

    table[types.CodeType] = code_reduce
    _installed = True
