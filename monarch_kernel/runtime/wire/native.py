"""The optional C hot path of the wire (``_wire``, built from native/wire.c): encoding,
signing and framing a message in one call, and cutting, checking and decoding one in
another.  The pure-Python path (``auth.py``, ``framing.py``, ``envelope.py``) speaks the same
wire format and is used when the extension is not built or ``MONARCH_KERNEL_NATIVE_WIRE=0``.
Importing this module loads nothing.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from .. import config

log = logging.getLogger("monarch_kernel.runtime")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    try:
        from . import _wire
    except ImportError as e:
        return None, (f"the native wire extension is not built ({e}); install OpenSSL's headers "
                      "(Debian: libssl-dev) and reinstall monarch-kernel")
    return _wire, ""


def is_available() -> tuple[bool, str]:
    """Whether the C hot path is built, and if not, why and how to get it."""
    native, why = _load()
    return native is not None, why


@functools.lru_cache(maxsize=1)
def _said_once(why: str) -> None:
    log.info("monarch_kernel: messages take the pure-Python path: %s", why)


@functools.lru_cache(maxsize=1)
def _zmq_bound() -> ModuleType | None:
    """The extension with the functions of the libzmq pyzmq loaded bound into it, or None
    (no extension, or that libzmq cannot be found: pyzmq's own calls are used)."""
    native, _why = _load()
    if native is None:
        return None
    import zmq

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libzmq" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            native.bind_libzmq(path, zmq.ZMQError)
            return native
        except OSError as e:
            log.debug("monarch_kernel: libzmq at %s not used: %s", path, e)
    return None


def sockets() -> ModuleType | None:
    """The extension's ``recv``/``send`` of one first frame straight through libzmq, when it
    is built, wanted and bound (else None: pyzmq's calls)."""
    return _zmq_bound() if config.native_wire() else None


def wire() -> ModuleType | None:
    """The extension if it is built and wanted (``MONARCH_KERNEL_NATIVE_WIRE``), else None
    (the slower path is said once, in the log)."""
    if not config.native_wire():
        return None
    native, why = _load()
    if native is None:
        _said_once(why)
    return native
