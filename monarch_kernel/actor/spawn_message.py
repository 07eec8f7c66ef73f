"""What a spawn sends the ranks: the actor's class and arguments, pickled, and its options.
Shared by a first spawn (``ProcMesh.spawn``) and a respawn on replaced ranks (rank_repair.py).
"""

from __future__ import annotations

from ..runtime import SpawnInfo


def spawn_options(cls) -> SpawnInfo | None:
    return SpawnInfo(main_thread=True) if getattr(cls, "runs_on_main_thread", False) else None


def spawn_body(cls, args, kwargs) -> list:
    from ..runtime import describe_unpicklable, dumps

    try:
        return dumps((cls, args, kwargs))
    except Exception as e:
        why = describe_unpicklable((cls, args, kwargs), e)
        raise TypeError(f"{cls.__qualname__}(...) cannot be sent to the ranks: {why}") from e
