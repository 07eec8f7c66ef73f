"""The rank side of debugging: debugpy started on demand, and the namespace views that
JupyterLab's debugger asks for when the rank is not stopped.

Runs inside rank processes (imported by the console actor).  It never starts debugpy
unless asked, and never listens beyond loopback unless the user named another host.
"""

from __future__ import annotations

import os
import threading

from ..actor.actor import Actor
from ..actor.endpoint import endpoint

# Ranks run without -Xfrozen_modules=off; breakpoints in cells do not need it.
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
_listen_lock = threading.Lock()
_listening: tuple[str, int] | None = None
_namespace: dict = {}  # the console's namespace on this rank (share_namespace)


def share_namespace(ns: dict) -> None:
    """The console's namespace, for the inspector to show while the console is busy."""
    global _namespace
    _namespace = ns


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
            self._view = NamespaceView(_namespace)
        return self._view.variables(ref)

    @endpoint
    def rich(self, name: str) -> tuple[dict, dict]:
        if name not in _namespace:
            raise NameError(f"name {name!r} is not defined on this rank")
        return rich(_namespace[name])

    @endpoint
    def write_source(self, path: str, text: str) -> None:
        write_source(path, text)

    @endpoint
    def interrupt(self, actor_id: str) -> bool:
        """Interrupt the console while debugpy holds the rank at a breakpoint.  debugpy
        suspends every traced thread then, the IO loop included, so the usual interrupt
        message would wait; this actor's own thread is untraced and reads its own inbox."""
        from ..runtime.process import Runtime

        return Runtime.current().interrupt_actor(actor_id)

# Names JupyterLab's variable panel should not show: the console's own plumbing.
HIDDEN = frozenset({"__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
                    "__builtins__", "__builtin__", "display", "_"})


def listening() -> tuple[str, int] | None:
    return _listening


def listen(host: str = "127.0.0.1") -> tuple[str, int]:
    """Start debugpy in this rank (once); the (host, port) a DAP client connects to."""
    global _listening
    with _listen_lock:
        if _listening is not None:
            return _listening
        import debugpy

        # Ranks are not meant to spawn debugged children of their own.
        debugpy.configure(subProcess=False)
        got = debugpy.listen((host, 0))
        _listening = (str(got[0]), int(got[1]))
        return _listening


def write_source(path: str, text: str) -> None:
    """Put a cell's text where the debugger will look for it (same path on every host)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class NamespaceView:
    """pydevd's variable tree over a namespace, for ``inspectVariables`` while not stopped.

    Variable references are pydevd's own, so JupyterLab can expand them with ``variables``.
    """

    def __init__(self, ns: dict):
        # Importing debugpy.server first sets up the pydevd import paths.
        from debugpy.server import api  # noqa: F401
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
    return name not in HIDDEN and not (name.startswith("_") and name[1:].isdigit())


def rich(value) -> tuple[dict, dict]:
    """The mime bundle of ``value``, as IPython would display it (plain repr without IPython)."""
    try:
        from IPython.core.formatters import DisplayFormatter
    except ImportError:
        return {"text/plain": repr(value)}, {}
    data, md = DisplayFormatter().format(value)
    return data, {k: v for k, v in md.items() if k in data}


def package_dir() -> str:
    """The monarch_kernel package folder: its frames are skipped when stepping."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
