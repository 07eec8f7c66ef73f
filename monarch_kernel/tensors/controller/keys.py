"""``KeyTable``: the keys of one activation's rendezvous, kept in the controller for the
ranks' process groups (what torch's ``TCPStore`` keeps, with the same answers), and the
waits on keys not set yet.  It lives on one actor's event loop and is only touched there;
a wait never holds up the other operations.  It opens nothing and imports no torch.
"""

from __future__ import annotations

import asyncio


class _Waiter:
    __slots__ = ("missing", "done")

    def __init__(self, missing: set[str], done: asyncio.Future):
        self.missing, self.done = missing, done


class KeyTable:
    """Keys to bytes, as torch's stores keep them::

        table.set("g/0", b"addr")
        await table.wait(["g/0", "g/1"], timeout=30.0)   # once rank 1 has set its key
    """

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._waiting: dict[str, set[_Waiter]] = {}

    def set(self, key: str, value: bytes) -> None:
        self._values[key] = _as_bytes(value)
        self._woke(key)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set takes as many values as keys, not {len(values)} for {len(keys)}")
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 when unset); its new value."""
        old = self._values.get(key, b"0")
        try:
            value = int(old) + int(amount)
        except ValueError:
            raise ValueError(f"add({key!r}): the key holds {old[:40]!r}, not a counter") from None
        self._values[key] = str(value).encode()
        self._woke(key)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """``desired`` replaces the value if it is ``expected`` (or the key is unset and
        ``expected`` empty); the value the key holds afterwards (``expected`` when unset)."""
        expected, desired = _as_bytes(expected), _as_bytes(desired)
        have = self._values.get(key)
        if (have is None and not expected) or have == expected:
            self.set(key, desired)
            return desired
        return expected if have is None else have

    def append(self, key: str, value: bytes) -> None:
        self.set(key, self._values.get(key, b"") + _as_bytes(value))

    def delete_key(self, key: str) -> bool:
        return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    def check(self, keys: list[str]) -> bool:
        return all(k in self._values for k in keys)

    async def wait(self, keys: list[str], timeout: float | None, values: bool = False) -> list[bytes] | None:
        """Once every key of ``keys`` is set: their values (``values``), or None.  Raises
        ``TimeoutError`` after ``timeout`` seconds (None: no limit) naming the keys missing."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            missing = {k for k in keys if k not in self._values}
            if not missing:
                return [self._values[k] for k in keys] if values else None
            waiter = _Waiter(missing, loop.create_future())
            for k in missing:
                self._waiting.setdefault(k, set()).add(waiter)
            try:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(waiter.done, left)
            except asyncio.TimeoutError:
                raise TimeoutError(f"the rendezvous waited {timeout:g} s for keys {sorted(waiter.missing)} that no "
                                   "rank set (a peer never made its part of the group)") from None
            finally:
                self._forget(waiter)

    def waiting(self) -> dict[str, int]:
        """``{key: how many waits want it}``: what the ranks wait for now (a group whose
        making hangs names the member that never came)."""
        return {k: len(ws) for k, ws in self._waiting.items()}

    def clear(self) -> None:
        """Drop every key; waits still running fail."""
        self._values.clear()
        waiting, self._waiting = self._waiting, {}
        for waiter in {w for ws in waiting.values() for w in ws}:
            if not waiter.done.done():
                waiter.done.set_exception(RuntimeError("the rendezvous was closed (the mesh stopped)"))

    def _woke(self, key: str) -> None:
        for waiter in self._waiting.pop(key, ()):
            waiter.missing.discard(key)
            if not waiter.missing and not waiter.done.done():
                waiter.done.set_result(None)

    def _forget(self, waiter: _Waiter) -> None:
        for k in waiter.missing:
            left = self._waiting.get(k)
            if left is not None:
                left.discard(waiter)
                if not left:
                    del self._waiting[k]


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
