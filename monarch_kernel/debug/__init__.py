"""Debugging meshes from a notebook: JupyterLab's debugger on any rank, and pdb on ranks.

Kernel side: ``proxy`` and ``rank_target`` (``MeshDebugger``, ipykernel's debugger that
relays the frontend's DAP session to a rank's debugpy), ``tunnel`` (the DAP client it uses:
calls to the rank's relay, never a socket to the rank) and ``pdb_controller`` (ranks stopped
in ``breakpoint()`` served at the notebook's stdin).  Rank side: ``rank_debugpy`` (debugpy
started on demand), ``relay`` (the tunnel's rank end, on the rank's loopback),
``inspector`` (the variable panel while a rank runs) and ``pdb_rank`` (``breakpoint()`` and
post-mortem stops).  Both sides: ``dap`` (DAP framing and the client core) and
``messages`` (what travels between them).  Importing any of these installs nothing.
"""
