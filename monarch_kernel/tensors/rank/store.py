"""``MeshStore``: a ``torch.distributed.Store`` whose keys are kept by the controller
(``Rendezvous``), for gloo and nccl to make the ranks' groups over.  Each operation is one
of the runtime's signed messages, so no listener is opened for it; a ``get`` or ``wait`` of a key
not set yet blocks (this thread only) until a peer sets it or the timeout passes, as on a
``TCPStore``.  Operations happen when a group is made, never per collective.

Imports torch: import it only where a group is made.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..rendezvous import Keeper


class MeshStore(dist.Store):
    """The store of one rendezvous in this process::

        store = MeshStore(rendezvous.keeper, datetime.timedelta(seconds=300))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, size, opts)

    Keep a reference to it while torch uses it: torch holds only its C++ half, and a
    Python store whose Python object is gone answers nothing.
    """

    def __init__(self, keeper: Keeper, timeout: datetime.timedelta):
        super().__init__()
        self._keeper = keeper
        self._clones: list[MeshStore] = []
        self.set_timeout(timeout)

    def _ask(self, op: str, *args, seconds: float | None | bool = True):
        """Ask the keeper; ``seconds``: how long it may take (True: the store's timeout)."""
        limit = _seconds(self._limit()) if seconds is True else seconds
        try:
            return self._keeper.ask(op, args, limit)
        except TimeoutError as e:
            raise dist.DistStoreError(f"{e} (collective_timeout; MONARCH_KERNEL_COLLECTIVE_TIMEOUT)") from None

    def _limit(self) -> datetime.timedelta:
        """The timeout torch set (``set_timeout``; init_process_group sets its own)."""
        return self.timeout  # type: ignore[attr-defined]  # (torch's stub omits Store.timeout)

    # torch's Store interface (names as torch calls them from Python and from C++)
    def set(self, key: str, value) -> None:
        self._ask("set", key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask("wait", [key], True)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._ask("wait", list(keys), True)

    def multi_set(self, keys: list[str], values: list) -> None:
        self._ask("multi_set", list(keys), [_as_bytes(v) for v in values])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._ask("wait", list(keys), False, seconds=_seconds(self._limit() if timeout is None else timeout))

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", list(keys))

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._ask("compare_set", key, _as_bytes(expected), _as_bytes(desired))

    def append(self, key: str, value) -> None:
        self._ask("append", key, _as_bytes(value))

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", key)

    def num_keys(self) -> int:
        return self._ask("num_keys")

    deleteKey = delete_key  # what torch's C++ side calls (through PrefixStore)  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def clone(self) -> MeshStore:
        # torch keeps only its C++ half: the Python object, whose methods it calls, lives here.
        twin = MeshStore(self._keeper, self._limit())
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        return True


def _seconds(limit: datetime.timedelta) -> float | None:
    """A torch timeout in seconds; None for torch's "no timeout" (zero)."""
    return limit.total_seconds() if limit > datetime.timedelta(0) else None


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
