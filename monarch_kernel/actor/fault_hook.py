"""What happens to a failure nobody handled: ``unhandled_fault_hook``.

The default reports and carries on: a controller inside a notebook kernel must never exit
because a rank did (unless ``MONARCH_KERNEL_STRICT=1`` asks for Monarch's exit).
Replace it (``monarch_kernel.unhandled_fault_hook = fn``) to do more.
"""

from __future__ import annotations

import logging
import os
import sys

from ..runtime import MeshFailure, config

log = logging.getLogger(__name__)

def unhandled_fault_hook(failure: MeshFailure) -> None:
    """Default: print the failure to stderr; never exit the process.  With
    ``MONARCH_KERNEL_STRICT=1`` it then exits the process with status 1, as Monarch's does.

    Example::

        import monarch_kernel

        def my_hook(failure):
            print("mesh failure:", failure)

        monarch_kernel.unhandled_fault_hook = my_hook
    """
    log.error("monarch_kernel: unhandled failure on mesh '%s':\n%s", failure.mesh, failure.report())
    if config.strict():
        # Monarch's hook ends the client; from the IO thread sys.exit would end only that
        # thread, so leave the process at once, as Monarch does, after flushing.
        sys.stdout.flush()
        os._exit(1)


def route_unhandled(rt) -> None:
    """Send ``rt``'s unhandled failures to ``monarch_kernel.unhandled_fault_hook`` (once per
    runtime; called when this process first spawns, since only spawned meshes fail)."""
    if not rt.hooks.unhandled.has(_dispatch):
        rt.hooks.unhandled.install(_dispatch)


def _dispatch(failure: MeshFailure) -> None:
    """Call whatever ``monarch_kernel.unhandled_fault_hook`` is now (users may replace it)."""
    pkg = sys.modules.get("monarch_kernel")
    hook = getattr(pkg, "unhandled_fault_hook", unhandled_fault_hook)
    try:
        hook(failure)
    except Exception as e:  # a broken hook must not take the IO thread down
        log.error("monarch_kernel: unhandled_fault_hook raised %r", e)
