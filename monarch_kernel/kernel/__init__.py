"""The Jupyter face, in the kernel process: ``MeshKernel``, its kernelspec, the ``%mesh``
magics, running ``%%mesh`` cells, rank output in cells, status, detached meshes.  It uses
only the public API and the runtime's hooks, which it installs when the magics load and
removes when they unload (kernel shutdown, ``%unload_ext``)."""


def load_magics(shell):
    """Register ``%mesh`` on an IPython shell (once); returns its ``MeshMagics``."""
    from .magics import MeshMagics

    for magics in shell.magics_manager.registry.values():
        if isinstance(magics, MeshMagics):
            return magics
    magics = MeshMagics(shell)
    shell.register_magics(magics)
    return magics


def unload_magics(shell) -> None:
    """Take the runtime hooks of this shell's ``%mesh`` out again."""
    from .magics import MeshMagics

    for magics in list(shell.magics_manager.registry.values()):
        if isinstance(magics, MeshMagics):
            magics.session.close()
