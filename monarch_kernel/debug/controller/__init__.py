"""The kernel's half of debugging: runs in the Jupyter kernel (the controller), never on a rank.

``proxy`` (``MeshDebugger``, ipykernel's debugger relaying the frontend's DAP session to one
rank), ``rank_target`` (what that session asks of the chosen rank), ``tunnel`` (the DAP client
over calls to the rank's relay), ``pdb_controller`` (``PdbHub``: ranks stopped in
``breakpoint()`` served at the notebook's stdin), ``rank_stop`` (one rank's pdb session as
the kernel sees it) and ``pdb_prompt`` (the ``(mesh pdb)`` prompt).
"""
