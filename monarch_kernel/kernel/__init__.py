"""The Jupyter face: ``MeshKernel``, its kernelspec, the ``%mesh`` magics and the console
actor that gives each rank a persistent namespace.  It uses only the public API and the
runtime's output-sink hook."""


def load_magics(shell) -> None:
    """Register ``%mesh`` on an IPython shell (once)."""
    from .magics import MeshMagics

    if "mesh" not in shell.magics_manager.magics["line"]:
        shell.register_magics(MeshMagics)
    try:
        from .cell_code import keep_cell_filenames
    except ImportError:  # no ipykernel: cells have no file names to keep
        return
    keep_cell_filenames()
