"""Each rank's last line, as ``%mesh status`` and the Mesh panel show it: the last thing the
rank printed that says something.  Noise never hides real output: a Python warning (its
``file:line: XWarning: ...`` line and the source line printed under it, such as torch's
"Failed to initialize NumPy" at import) and profiler chatter (kineto's ``USDT:``, ``STAGE:``
lines) are a rank's last line only while it has printed nothing else.  Runs in the kernel;
fed by the output sink's watchers, on the IO thread, so it only records.
"""

from __future__ import annotations

import re

from ..spmd.rank.profiler import CHATTER

# What warnings.showwarning prints first: "path.py:12: UserWarning: message".
WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")


def noise(line: str) -> bool:
    """Whether ``line`` (of stderr) is profiler chatter (torch's kineto, printing from C++)."""
    return CHATTER.match(line) is not None


class LastLines:
    """(mesh, rank) -> its last line that says something (``get``, as a dict's)."""

    def __init__(self):
        self._said: dict[tuple[str, int], str] = {}
        self._noise: dict[tuple[str, int], str] = {}
        self._in_warning: set[tuple[str, int]] = set()  # its last stderr line began a warning

    def note(self, mesh: str, rank: int, stream: str, line: str) -> None:
        """A line rank ``rank`` of ``mesh`` printed (an output sink's watcher)."""
        if not line.strip():
            return
        key = (mesh, rank)
        if stream == "stderr":
            warned = key in self._in_warning
            self._in_warning.discard(key)
            if WARNING.match(line):
                self._in_warning.add(key)
                self._noise[key] = line
                return
            if (warned and line.startswith("  ")) or noise(line):  # the warning's source line; chatter
                return
        self._said[key] = line

    def get(self, key: tuple[str, int], default: str = "") -> str:
        return self._said.get(key) or self._noise.get(key, default)

    def forget(self, mesh: str) -> None:
        """Mesh ``mesh`` is gone: a new mesh of its name starts with no last lines."""
        for table in (self._said, self._noise):
            for key in [k for k in table if k[0] == mesh]:
                del table[key]
        self._in_warning = {k for k in self._in_warning if k[0] != mesh}
