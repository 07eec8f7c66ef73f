"""Code sync: ``ProcMesh.sync_workspace`` sends a folder's changed files to each host of a
mesh, into a per-job copy on the ranks' ``sys.path``, and re-imports what changed.
``workspace.py`` is the controller's half, ``workspace_copy.py`` the ranks' (an actor per
host's copy)."""
