"""Unpickling that imports one module at a time per process.

Each actor has a thread of its own, so actors spawned together unpickle their classes and
arguments at the same time; two threads importing torch at once break it (``KeyError:
'torch'``, partially initialized modules, pybind types defined twice).  Monarch never meets
this: its actors share one thread.  Here the first thread whose message names a module not
yet imported (or whose package is still being imported) imports it in the process's one
import turn, so a module is imported whole before another message's unpickling uses it.
A message that names no global (plain values) never looks for the turn.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import sys
import threading

# STACK_GLOBAL, by which protocol 4 and 5 pickles (all the runtime makes) name a module's
# attribute.  A byte 0x93 inside some other data only costs the slower path.
_NAMES_A_GLOBAL = re.compile(b"\x93").search
_turn = (os.getpid(), threading.RLock())


def _the_turn() -> threading.RLock:
    """The process's import turn (a forked child's own: whoever held its parent's is not there)."""
    global _turn
    pid, lock = _turn
    if pid != os.getpid():
        _turn = (os.getpid(), lock := threading.RLock())
    return lock


def _importing(name: str) -> bool:
    found = sys.modules.get(name)
    return found is None or getattr(getattr(found, "__spec__", None), "_initializing", False)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if _importing(module) or _importing(module.partition(".")[0]):
            with _the_turn():  # whoever imports it now finishes first
                importlib.import_module(module)
        return super().find_class(module, name)


def loads(data, buffers=None):
    """``pickle.loads(data, buffers=buffers)``, importing what it names in this process's turn."""
    if _NAMES_A_GLOBAL(data) is None:
        return pickle.loads(data, buffers=buffers)
    return _Unpickler(io.BytesIO(data), buffers=buffers).load()
