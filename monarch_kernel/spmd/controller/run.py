"""What ``%mesh run`` sends to a notebook's consoles: one line that runs a torchrun script
through the ranks' ``run_script``, after ``setup_torch_elastic_env`` gave them torchrun's
variables.  Runs in the kernel; it builds text and runs nothing.
"""

from __future__ import annotations


def console_code(script_args) -> str:
    """The one line a notebook console runs for ``%mesh run`` (leaves no names behind)."""
    return f"__import__('monarch_kernel.spmd').spmd.run_script({list(script_args)!r}) and None\n"
