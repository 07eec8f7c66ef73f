"""Shapes, hosts and proc meshes (public layer above the runtime)."""
