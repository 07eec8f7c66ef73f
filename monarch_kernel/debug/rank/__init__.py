"""The ranks' half of debugging: runs in each rank process, never imports the kernel's half.

``rank_debugpy`` (debugpy started on demand), ``debug_adapter`` (debugpy's adapter as the rank's
child, taking clients only from the rank), ``peer_uid`` (whose a loopback connection is),
``relay`` (``DapRelay``, the tunnel's rank end), ``inspector`` (the variable panel while the rank
runs) and ``pdb_rank`` (``breakpoint()`` and post-mortem stops reported to the kernel).
"""
