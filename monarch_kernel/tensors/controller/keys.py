"""``KeyTable``: the keys of one activation's rendezvous, kept in the controller for the
ranks' process groups (what torch's ``TCPStore`` keeps, with the same answers), and the
waits on keys not set yet.  A wait never blocks: its answer goes to a callback, at once or
when the keys are set (or it expires), so one rank's wait holds no other operation up.
It opens nothing and imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# How a wait is answered: ``reply(values, None)`` (values: the keys' values, or None when
# they were not asked for), or ``reply(None, error)``.
Reply = Callable[[Any, BaseException | None], None]


class Waiter:
    """One pending wait (``KeyTable.wait``), for ``KeyTable.expire``."""

    __slots__ = ("keys", "missing", "values", "reply", "timeout")

    def __init__(self, keys: list[str], missing: set[str], values: bool, reply: Reply, timeout: float | None):
        self.keys, self.missing, self.values, self.reply, self.timeout = keys, missing, values, reply, timeout


class KeyTable:
    """Keys to bytes, as torch's stores keep them; thread-safe::

        table.set("g/0", b"addr")
        table.wait(["g/0", "g/1"], True, reply, 30.0)   # reply(values, None) once rank 1 set its key
    """

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._waiting: dict[str, set[Waiter]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set takes as many values as keys, not {len(values)} for {len(keys)}")
        with self._lock:
            self._check_open()
            for key, value in zip(keys, values, strict=True):
                self._values[key] = _as_bytes(value)
            ready = self._woke(keys)
        _answer(ready)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 when unset); its new value."""
        with self._lock:
            self._check_open()
            old = self._values.get(key, b"0")
            try:
                value = int(old) + int(amount)
            except ValueError:
                raise ValueError(f"add({key!r}): the key holds {old[:40]!r}, not a counter") from None
            self._values[key] = str(value).encode()
            ready = self._woke([key])
        _answer(ready)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` replaces the value if it is ``expected`` (or the key is unset and
        ``expected`` empty); the value the key holds afterwards (``expected`` when unset)."""
        expected, desired = _as_bytes(expected), _as_bytes(desired)
        with self._lock:
            self._check_open()
            have = self._values.get(key)
            if not ((have is None and not expected) or have == expected):
                return expected if have is None else have
            self._values[key] = desired
            ready = self._woke([key])
        _answer(ready)
        return desired

    def append(self, key: str, value: bytes) -> None:
        with self._lock:
            self._check_open()
            self._values[key] = self._values.get(key, b"") + _as_bytes(value)
            ready = self._woke([key])
        _answer(ready)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._lock:
            return len(self._values)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._values for k in keys)

    def wait(self, keys: list[str], values: bool, reply: Reply, timeout: float | None = None) -> Waiter | None:
        """Answer ``reply`` once every key of ``keys`` is set: at once (returns None), or
        later (returns the ``Waiter``, which ``expire`` fails after ``timeout`` seconds)."""
        with self._lock:
            self._check_open()
            missing = {k for k in keys if k not in self._values}
            if missing:
                waiter = Waiter(list(keys), missing, values, reply, timeout)
                for k in missing:
                    self._waiting.setdefault(k, set()).add(waiter)
                return waiter
            got = [self._values[k] for k in keys] if values else None
        reply(got, None)
        return None

    def expire(self, waiter: Waiter) -> None:
        """``waiter``'s time is up: it fails naming the keys still missing (if not answered)."""
        with self._lock:
            if not self._forget(waiter):
                return
        limit = "" if waiter.timeout is None else f"{waiter.timeout:g} s "
        waiter.reply(None, TimeoutError(f"the rendezvous waited {limit}for keys {sorted(waiter.missing)} that no "
                                        "rank set (a peer never made its part of the group)"))

    def waiting(self) -> dict[str, int]:
        """``{key: how many waits want it}``: what the ranks wait for now (a group whose
        making hangs names the member that never came)."""
        with self._lock:
            return {k: len(ws) for k, ws in self._waiting.items()}

    def close(self) -> None:
        """Drop every key; pending waits fail, later operations raise."""
        with self._lock:
            self._closed = True
            self._values.clear()
            waiting, self._waiting = self._waiting, {}
        error = RuntimeError("the rendezvous was closed (its mesh stopped); activate a live mesh for new groups")
        for waiter in {w for ws in waiting.values() for w in ws}:
            waiter.reply(None, error)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the rendezvous was closed (its mesh stopped); activate a live mesh for new groups")

    def _woke(self, keys: list[str]) -> list[tuple[Waiter, list[bytes] | None]]:
        """(Under the lock) the waits that ``keys`` being set completes, with their answers."""
        ready = []
        for key in keys:
            for waiter in self._waiting.pop(key, ()):
                waiter.missing.discard(key)
                if waiter.missing:
                    continue
                gone = {k for k in waiter.keys if k not in self._values}  # deleted since the wait began
                if gone:
                    waiter.missing = gone
                    for k in gone:
                        self._waiting.setdefault(k, set()).add(waiter)
                    continue
                ready.append((waiter, [self._values[k] for k in waiter.keys] if waiter.values else None))
        return ready

    def _forget(self, waiter: Waiter) -> bool:
        """(Under the lock) drop a pending wait; False if it was answered already."""
        pending = False
        for k in waiter.missing:
            left = self._waiting.get(k)
            if left is not None and waiter in left:
                pending = True
                left.discard(waiter)
                if not left:
                    del self._waiting[k]
        return pending


def _answer(ready: list[tuple[Waiter, list[bytes] | None]]) -> None:
    for waiter, got in ready:
        waiter.reply(got, None)


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
