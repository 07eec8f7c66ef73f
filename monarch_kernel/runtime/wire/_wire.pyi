"""Type stub of the native wire extension built from native/wire.c (see runtime/wire/native.py)."""

from collections.abc import Callable
from typing import Any

class Keys:
    """HMAC-SHA256 states of one job key."""

    def __init__(self, key: bytes) -> None: ...

def seal(keys: Keys, header: Any, body: list) -> list:
    """Encode, sign and pack one message: ``[first frame, large frames...]``."""

def open(keys: Keys, keyring: dict[str, Keys] | None, frames: list, header_cls: type,
         decode_payload: Callable[[int, Any], Any], max_frame: int, max_frames: int) -> tuple[Any, list] | str:
    """``(header, body)`` of an authentic message, or why it is dropped (a ``DropCounts`` field)."""

def clear_cache() -> None:
    """Forget the decoded payloads kept for reuse."""
