"""Actors and meshes, one layer (as Monarch's ``_src/actor/``) above the runtime: ``Actor``,
endpoints and what calling them returns; shapes, ``HostMesh`` and ``ProcMesh``, what
happens to a failure nobody handled (``fault_hook``), and the actors a mesh spawns for
itself (``logging_option``; ``code_sync/``'s workspace copies).  It reaches distributed
tensors, a layer above, only through ``tensor_shim``."""
