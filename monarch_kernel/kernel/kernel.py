"""``MeshKernel``: ipykernel's IPythonKernel with the ``%mesh`` magics loaded.

Kept thin on purpose: the controller is the runtime, usable without Jupyter; the kernel
only adds magics and sends rank output into the running cell.
"""

from __future__ import annotations

from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp
from traitlets import Type


class MeshKernel(IPythonKernel):
    implementation = "monarch_kernel"
    implementation_version = "0.1.0"
    # JupyterLab's debugger: the kernel itself, or the rank chosen with %mesh debug R.
    debugger_class = Type("monarch_kernel.debug.controller.proxy.MeshDebugger")
    banner = "monarch-kernel: Python 3 as the single controller of a mesh (try  %mesh spawn -n 4)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from . import load_magics

        load_magics(self.shell)

    def do_shutdown(self, restart):
        from . import unload_magics

        unload_magics(self.shell)  # the runtime's hooks go with the kernel
        return super().do_shutdown(restart)


class MeshKernelApp(IPKernelApp):
    name = "monarch-kernel"
    # A traitlets Type, as IPKernelApp declares it; its stubs type the base's value as a plain class.
    kernel_class = Type(MeshKernel, klass="ipykernel.kernelbase.Kernel").tag(config=True)  # type: ignore[assignment]


def main() -> None:
    import os

    # debugpy (the kernel's own debugger) would warn at start that frozen modules may hide
    # breakpoints; cells do not need them.  Set here, by the kernel's entry, never at import.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    MeshKernelApp.launch_instance()
