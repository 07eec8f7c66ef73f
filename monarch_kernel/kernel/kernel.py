"""``MeshKernel``: ipykernel's IPythonKernel with the ``%mesh`` magics loaded.

Kept thin on purpose: the controller is the runtime, usable without Jupyter; the kernel
only adds magics, sends rank output into the running cell, hands Tab and Shift-Tab in mesh
cells to a rank (``rank_completion``), and gives the settings a
controller reads (``runtime/config.py``) as traitlets: ``--MeshKernel.heartbeat_timeout=7``
on its command line, or ``c.MeshKernel.heartbeat_timeout = 7`` in a config file.  Three
guards against ipykernel's edges: garbage on its ports (``port_guard``), the order of a
failed cell's reply and the abort of what was queued behind it, and no busy/idle status for
the Mesh panel's requests (``quiet_status``: JupyterLab would show their "idle" as the
notebook's while a cell runs).
"""

from __future__ import annotations

from typing import Any

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from jupyter_core.paths import jupyter_config_path
from traitlets import Bool, Float, Integer, TraitType, Type, Unicode, observe
from traitlets.config import Application

from ..runtime import config, diagnostics
from .panel.messages import COMM_TARGET
from .port_guard import PortGuard
from .quiet_status import QuietRequests
from .rank_completion import KEY, RankCompletion

_TRAITS: dict[type, type[TraitType]] = {int: Integer, float: Float, str: Unicode, bool: Bool}


def _setting(name: str) -> Any:
    """A traitlet for setting ``name`` of ``runtime/config.py``.  None (not configured): the
    setting's environment variable decides, else its default."""
    s = config.setting(name)
    text = f"{s.help}.  Not set: ${s.env}, else {s.default_text()}."
    return _TRAITS[s.type](None, allow_none=True, help=text).tag(config=True)


class MeshKernel(IPythonKernel):
    implementation = "monarch_kernel"
    implementation_version = "0.1.0"
    # JupyterLab's debugger: the kernel itself, or the rank chosen with %mesh debug R.
    debugger_class = Type("monarch_kernel.debug.controller.proxy.MeshDebugger")
    banner = "monarch-kernel: Python 3 as the single controller of a mesh (try  %mesh spawn -n 4)"

    # The settings a controller reads; ranks spawned from here get them too (config.exported_env).
    fanout = _setting("fanout")
    spawn_timeout = _setting("spawn_timeout")
    reach_timeout = _setting("reach_timeout")
    check_limits = _setting("check_limits")
    rank_memory = _setting("rank_memory")
    heartbeat_timeout = _setting("heartbeat_timeout")
    max_frame = _setting("max_frame")
    max_line = _setting("max_line")
    send_queue = _setting("send_queue")
    send_block = _setting("send_block")
    bind_address = _setting("bind_address")
    strict = _setting("strict")
    stacks_py_spy = _setting("stacks_py_spy")
    record_history = _setting("record_history")
    history_dir = _setting("history_dir")
    history_max_bytes = _setting("history_max_bytes")
    history_sample = _setting("history_sample")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from . import load_magics

        diagnostics.install()
        # Garbage on the Jupyter ports: counted and said in one line, not a traceback per frame.
        self.port_guard = PortGuard().install(self.iopub_thread)
        self.quiet = QuietRequests((COMM_TARGET,), self._comm_target)
        for s in config.kernel_settings():
            if getattr(self, s.name) is not None:  # configured (command line, config file)
                config.set(s.name, getattr(self, s.name))
        # Tab and Shift-Tab in mesh cells: answered by a rank (rank_completion.py).
        self.rank_completion = RankCompletion(load_magics(self.shell).session)

    # ipykernel (7.x) sends a failed cell's reply, then starts aborting the requests queued
    # behind it, and stops aborting when a marker it posts reaches the shell queue; a client
    # that sends its next cell as soon as the reply arrives (a test, a script, the stop
    # button then a quick re-run) can get its request in before the marker, and it is
    # aborted though it came after the failure.  So the marker is posted before the reply.
    _aborted_early = False

    async def do_execute(self, code, silent, *args, **kwargs):
        reply = await super().do_execute(code, silent, *args, **kwargs)
        parent = self.get_parent("shell")
        if (not silent and reply.get("status") == "error" and self.shell_channel_thread
                and parent.get("content", {}).get("stop_on_error", True)):
            super()._abort_queues(parent.get("header", {}).get("subshell_id"))
            self._aborted_early = True
        return reply

    def _abort_queues(self, subshell_id=None):
        if self._aborted_early:  # done in do_execute, before the reply went out
            self._aborted_early = False
            return
        super()._abort_queues(subshell_id)

    def _comm_target(self, comm_id: str) -> str | None:
        comm = self.comm_manager.comms.get(comm_id)
        return None if comm is None else comm.target_name

    # ipykernel publishes every busy/idle through this method (7.x and 6.x alike).
    def _publish_status(self, status, channel, parent=None):
        if channel == "shell" and not self.quiet.publishes(status, parent or self.get_parent(channel)):
            return  # a request of the Mesh panel: not the notebook's work
        super()._publish_status(status, channel, parent)

    def do_complete(self, code, cursor_pos):
        cursor_pos = len(code) if cursor_pos is None else cursor_pos
        answer = self.rank_completion.complete(code, cursor_pos)
        return answer if isinstance(answer, dict) else _said(super().do_complete(code, cursor_pos), answer)

    def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        cursor_pos = len(code) if cursor_pos is None else cursor_pos
        answer = self.rank_completion.inspect(code, cursor_pos, detail_level, omit_sections)
        if isinstance(answer, dict):
            return answer
        return _said(super().do_inspect(code, cursor_pos, detail_level, omit_sections), answer)

    @observe(*(s.name for s in config.kernel_settings()))
    def _setting_changed(self, change) -> None:
        config.set(change["name"], change["new"])  # None gives the setting back to its variable

    def do_shutdown(self, restart):
        from . import unload_magics

        unload_magics(self.shell)  # the runtime's hooks go with the kernel
        self.port_guard.uninstall()
        return super().do_shutdown(restart)


def _said(reply: dict, why: str | None) -> dict:
    """The kernel's own reply to a mesh cell no rank answered, saying why in its metadata."""
    if why is not None:
        reply.setdefault("metadata", {})[KEY] = {"answered_by": "controller", "why": why}
    return reply


class MeshKernelApp(IPKernelApp):
    name = "monarch-kernel"
    # A traitlets Type, as IPKernelApp declares it; its stubs type the base's value as a plain class.
    kernel_class = Type(MeshKernel, klass="ipykernel.kernelbase.Kernel").tag(config=True)  # type: ignore[assignment]
    classes = [MeshKernel, *IPKernelApp.classes]  # so --help-all lists MeshKernel's settings

    def load_config_file(self, *args, **kwargs) -> None:
        """IPython's (the profile's ``ipython_config.py`` and ``monarch_kernel_config.py``),
        then, taking precedence, Jupyter's config path (``jupyter --paths``), as Jupyter's own
        applications read it: ``jupyter_config`` and ``monarch_kernel_config``, .py or .json."""
        super().load_config_file(*args, **kwargs)
        for name in ("jupyter_config", "monarch_kernel_config"):
            Application.load_config_file(self, name, path=jupyter_config_path())


def main() -> None:
    import os

    # debugpy (the kernel's own debugger) would warn at start that frozen modules may hide
    # breakpoints; cells do not need them.  Set here, by the kernel's entry, never at import.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    MeshKernelApp.launch_instance()
