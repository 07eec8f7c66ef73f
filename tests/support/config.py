"""``configured(**settings)``: settings for the length of a ``with``, through the runtime's
settings registry (``runtime/config.py``), given back as they were at its end.

What is given wins over the environment in this process and reaches the ranks it spawns
meanwhile (``config.exported_env``).  A variable that another kind of process must read (a
kernel, a script run with ``subprocess``) is still set in that process's environment."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from monarch_kernel.runtime import config


@contextlib.contextmanager
def configured(**settings) -> Iterator[None]:
    """``with configured(heartbeat_timeout=1.5): ...``; a setting's name as ``config.SETTINGS`` has it."""
    before: dict = {}  # what each setting given so far had: a constant named is refused at once
    try:
        for name, value in settings.items():
            was = config.given(name)
            config.set(name, value)
            before[name] = was
        yield
    finally:
        for name, was in before.items():
            config.set(name, was)
