"""Detached meshes: ranks owned by a small host process of their own, so they outlive the
kernel that started them.  ``host.py`` runs in that host process; ``records.py`` is the
record file both the host and kernels read; ``listing.py`` runs in the Jupyter Server
extension's short-lived helper (which meshes exist, who has each attached, stopping one);
the kernel's side is ``kernel/detached.py``.
"""
