"""Debugging meshes from a notebook: JupyterLab's debugger on any rank, and pdb on ranks.

Folders by the process that runs them: ``controller/`` runs in the kernel (the DAP proxy, the
tunnel, distributed pdb's hub and prompt), ``rank/`` on ranks (debugpy, the DAP relay, the
inspector, pdb's rank half).  Both sides use ``messages`` (what travels between them) and
``dap`` (DAP framing and the client core).  ``rank/`` never imports ``controller/``; importing
any of these installs nothing.
"""
