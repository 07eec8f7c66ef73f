"""The rank's answers to JupyterLab's variable panel while its console runs (or is stopped in)
a cell: the ``Inspector`` actor, pydevd's variable tree over the console's namespace, and
mime bundles of values.

Runs in rank processes (the kernel spawns one Inspector per debugged rank).  It must never
be traced or suspended by debugpy, and never wait on the console.
"""

from __future__ import annotations

import threading

from ...actor.actor import Actor
from ...actor.endpoint import endpoint
from ...runtime import Runtime
from . import rank_debugpy

# Names JupyterLab's variable panel should not show: the console's own plumbing, and its
# IPython shell's (as ipykernel's variable panel hides them).
HIDDEN = frozenset({"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
                    "__builtins__", "__builtin__", "display", "_", "__", "___", "_i", "_ii", "_iii",
                    "_ih", "_oh", "_dh", "In", "Out", "get_ipython", "exit", "quit", "_exit_code"})


class Inspector(Actor):
    """Answers JupyterLab's variable panel for this rank.

    A separate actor from the console on purpose: an actor takes one message at a time, so
    questions to the console would wait for the cell it is running (JupyterLab asks on
    every output line of that cell).  This one answers at once, from the same namespace.
    """

    def __init__(self):
        self._view: NamespaceView | None = None
        # Runs on this actor's own worker thread: keep debugpy from tracing (and suspending)
        # it, so the panel's questions and a stopped rank never wait on each other.
        threading.current_thread().pydev_do_not_trace = True

    @endpoint
    def variables(self, ref: int | None = None) -> list[dict]:
        """The namespace as the variable panel shows it (``ref``: expand one)."""
        if ref is None or self._view is None:
            if self._view is not None:
                self._view.close()
            self._view = NamespaceView(rank_debugpy.shared_namespace())
        return self._view.variables(ref)

    @endpoint
    def rich(self, name: str) -> tuple[dict, dict]:
        ns = rank_debugpy.shared_namespace()
        if name not in ns:
            raise NameError(f"name {name!r} is not defined on this rank")
        return rich(ns[name])

    @endpoint
    def write_source(self, path: str, text: str) -> None:
        rank_debugpy.write_source(path, text)

    @endpoint
    def interrupt(self, actor_id: str) -> bool:
        """Interrupt the console while debugpy holds the rank at a breakpoint.  debugpy
        suspends every traced thread then; this actor's own thread is untraced (as is the
        rank's IO thread once debugpy runs, ``rank_debugpy.start``), so the call gets here."""
        return Runtime.current().interrupt_actor(actor_id)


class NamespaceView:
    """pydevd's variable tree over a namespace, for ``inspectVariables`` while not stopped.

    Variable references are pydevd's own, so JupyterLab can expand them with ``variables``.
    """

    def __init__(self, ns: dict):
        rank_debugpy.quiet_pydevd()
        # Importing debugpy.server first sets up the pydevd import paths (keep this order).
        from debugpy.server import api  # noqa: F401, I001
        from _pydevd_bundle import pydevd_frame_utils
        from _pydevd_bundle.pydevd_api import PyDevdAPI
        from _pydevd_bundle.pydevd_suspended_frames import SuspendedFramesManager, _FramesTracker

        class _PyDB:
            variable_presentation = PyDevdAPI.VariablePresentation()

        class _Code:
            co_filename = "<mesh namespace>"
            co_name = "<module>"

        class _Frame:
            f_code = _Code()
            f_globals = f_locals = ns
            f_back = None
            f_lineno = 0

        self.manager = SuspendedFramesManager()
        self._tracker = _FramesTracker(self.manager, _PyDB())
        self._frame = _Frame()
        self._tracker.track("mesh-namespace", pydevd_frame_utils.create_frames_list_from_frame(self._frame))

    def variables(self, ref: int | None = None) -> list[dict]:
        var = self.manager.get_variable(ref or id(self._frame))
        return [v.get_var_data() for v in var.get_children_variables() if visible(v.get_var_data()["name"])]

    def close(self) -> None:
        self._tracker.untrack_all()


def visible(name: str) -> bool:
    """Whether the variable panel shows ``name`` (not the console's plumbing, nor ``_3``, ``_i3``)."""
    return name not in HIDDEN and not (name[:1] == "_" and name.lstrip("_i").isdigit())


def rich(value) -> tuple[dict, dict]:
    """The mime bundle of ``value``, as IPython would display it (plain repr without IPython)."""
    try:
        from IPython.core.formatters import DisplayFormatter
    except ImportError:
        return {"text/plain": repr(value)}, {}
    data, md = DisplayFormatter().format(value)
    return data, {k: v for k, v in md.items() if k in data}
