"""Warm replacements: which heavy modules a mesh's ranks have imported, read from outside.

A rank replaced by its mesh's restart policy is forked from a standby template that imported
them before forking (torch, numpy, ...), so it does not pay their import again.  They are
the packages whose compiled libraries a live rank has mapped (``/proc/PID/maps``): the ones
whose import is slow.  Pure-Python modules (most of the user's) are left to the rank.  A
package that starts threads or a GPU context at import is never one a template may hold:
those named in ``UNSAFE`` are left out.  Read where the rank runs (``/proc`` of its host): by
the controller for its own ranks, by a host's agent for that host's (``agent/warm_standby.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Packages a template must not import before forking: they initialise a GPU or start
# threads at import (a fork of them is broken), or are namespaces of libraries only.
UNSAFE = frozenset({"jax", "jaxlib", "tensorflow", "cupy", "pycuda", "triton", "nvidia", "numba", "ray",
                    "pynvml", "tensorrt"})


def _site_dirs() -> list[str]:
    """The folders installed packages live in, longest first (a venv's inside another's)."""
    dirs = {os.path.realpath(p) for p in sys.path
            if p and ("site-packages" in p or "dist-packages" in p) and os.path.isdir(p)}
    return sorted(dirs, key=len, reverse=True)


def mapped_packages(pid: int) -> list[str]:
    """The top-level installed packages whose compiled files process ``pid`` has mapped,
    sorted; [] if its maps cannot be read (gone, or another user's)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except (OSError, IndexError):
        return []
    found: set[str] = set()
    roots = _site_dirs()
    for path in paths:
        if not path.startswith("/"):
            continue
        for root in roots:
            if path.startswith(root + os.sep):
                top = path[len(root) + 1:].split(os.sep, 1)[0]
                name = top.split(".", 1)[0]  # _cffi_backend.cpython-312-x86_64-linux-gnu.so -> _cffi_backend
                if name.isidentifier() and not top.endswith(".libs") and ".dist-info" not in top:
                    found.add(name)
                break
    return sorted(found)


def warm_candidates(pid: int, already) -> list[str]:
    """What a standby template should import for ranks like ``pid``: its heavy packages that
    are importable here, not unsafe, and not imported by templates already (``already``)."""
    out = []
    for name in mapped_packages(pid):
        if name in UNSAFE or name in already or name in sys.builtin_module_names:
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError):
            continue
        out.append(name)
    return out
