"""Actors and meshes, one layer (as Monarch's ``_src/actor/``) above the runtime: ``Actor``,
endpoints and what calling them returns; shapes, rank specs, ``HostMesh`` and ``ProcMesh``,
and the actors a mesh spawns for itself (``logging_option``, ``workspace_copy``)."""
