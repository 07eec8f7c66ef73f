"""``monarch_kernel.metric(name, value, step=None)``: a user's figure, from any rank, into the
history.  On a rank it is one control line on its stdout (the path its prints take, read by the
process that owns its output, which records it and never shows it); in a controller it is
recorded directly.  Costs one small write; imports nothing heavy."""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time

from ..runtime import process_mesh
from .recorder import process_writer

_MARK = "\x1e\x1fmonarch:"  # rank_output.CONTROL_MARK, as text


def metric(name: str, value: float, step: int | None = None) -> None:
    """Record ``value`` of metric ``name`` (at ``step``) for this rank, in its host's history.

    Example::

        for step in range(100):
            loss = train_step()
            monarch_kernel.metric("loss", loss, step=step)

    Then ``%mesh history --plot loss``, or ``SELECT rank, max(value) FROM metrics WHERE name='loss'
    GROUP BY rank``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"metric(name, value, step=None): name must be a non-empty str, not {name!r}")
    if not isinstance(value, numbers.Real):
        try:
            value = float(value)  # a 0-d tensor, a numpy scalar
        except (TypeError, ValueError):
            raise TypeError(f"metric({name!r}, value): value must be a number, not {type(value).__name__}") from None
    if step is not None and not isinstance(step, numbers.Integral):
        raise TypeError(f"metric({name!r}, value, step=...): step must be an int or None, not {step!r}")
    value = float(value)
    at = time.time_ns() // 1000
    ref, rank = process_mesh
    if ref is None:  # a controller: its own history, under the name "controller"
        writer = process_writer()
        if writer is not None:
            writer.add("metrics", "controller", (at, None, name, step, value))
        return
    body = json.dumps({"n": name, "v": value if math.isfinite(value) else str(value), "s": step, "t": at},
                      separators=(",", ":"))
    try:
        sys.stdout.flush()  # what was printed before goes first
    except (ValueError, OSError):
        pass
    os.write(1, f"{_MARK}metric {body}\n".encode())
