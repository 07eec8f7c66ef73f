"""Actors, endpoints and what calling them returns (public layer above the runtime)."""
