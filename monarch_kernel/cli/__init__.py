"""``monarch-kernel`` (and ``python -m monarch_kernel``): the command line outside Jupyter.
``main`` is its click group (sphinx-click: ``.. click:: monarch_kernel.cli:main``).  A thin
face on the public API and the records detached meshes and running kernels leave; importing
it starts nothing."""

from .commands import main as main

__all__ = ["main"]
