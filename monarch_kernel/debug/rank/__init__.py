"""The ranks' half of debugging: runs in each rank process, never imports the kernel's half.

``rank_debugpy`` (debugpy started on demand, its adapter the rank's child: ``debug/debug_adapter``),
``relay`` (``DapRelay``, the tunnel's rank end), ``inspector`` (the variable panel while the rank
runs) and ``pdb_rank`` (``breakpoint()`` and post-mortem stops reported to the kernel).
"""
