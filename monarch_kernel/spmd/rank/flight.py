"""The collectives flight recorder on a rank: its process groups' recent collectives (sequence
number, op, sizes, dtype, group, when each started and whether it finished), for
``%mesh collectives``'s desync report.

torch's own recorder (``TORCH_FR_BUFFER_SIZE``, for gloo and nccl in the torch versions that
have ``_dump_fr_trace_json``) is switched on where spmd sets torchrun's variables, before a
group is made; a torch without it gets a Python-level recorder around torch.distributed's
collectives instead (``python_recorder``).  Runs on ranks; imports torch only when asked.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import deque

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
ENTRIES = 2000  # collectives each rank keeps (torch's ring buffer)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier")

_python: deque | None = None  # the Python-level recorder's entries, once installed
_seq = [0]
_lock = threading.Lock()


def enable(environ) -> None:
    """Switch torch's recorder on for groups made from now on (unless the user chose a size);
    a torch without one gets the Python-level recorder."""
    environ.setdefault(BUFFER_ENV, str(ENTRIES))
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return  # no torch.distributed here: nothing to record
    if not hasattr(c10d, "_dump_fr_trace_json"):
        python_recorder()


def _torch_dump() -> dict | None:
    try:
        import torch._C._distributed_c10d as c10d

        dump = c10d._dump_fr_trace_json  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return None
    try:
        return json.loads(dump(True, False))
    except Exception:  # noqa: BLE001 - no recorder in this group (a buffer of 0), or none made yet
        return None


def python_recorder() -> None:
    """Wrap torch.distributed's collectives to record them (a torch without its own recorder)."""
    global _python
    import torch.distributed as dist

    with _lock:
        if _python is not None:
            return
        _python = deque(maxlen=ENTRIES)
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, _recorded(name, fn))


def _recorded(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensor = next((a for a in args if hasattr(a, "shape")), None)
        group = kwargs.get("group")
        with _lock:
            _seq[0] += 1
            entry = {"seq": _seq[0], "op": name, "sizes": [list(tensor.shape)] if tensor is not None else [],
                     "dtype": str(tensor.dtype).removeprefix("torch.") if tensor is not None else "",
                     "group": getattr(group, "group_name", "default_pg") if group is not None else "default_pg",
                     "started_ns": time.time_ns(), "ended_ns": None}
            assert _python is not None
            _python.append(entry)
        try:
            return fn(*args, **kwargs)
        finally:
            entry["ended_ns"] = time.time_ns()  # (an async op: when it was enqueued)
    return wrapper


def snapshot(last: int = 4) -> dict:
    """This rank's recent collectives per group: ``{"recorder", "now_ns", "groups": {group:
    {"last_enqueued", "last_completed", "entries": [...]}}}``; ``recorder`` is ``None`` where
    no group exists."""
    import sys

    now = time.time_ns()
    if "torch.distributed" not in sys.modules:
        return {"recorder": None, "now_ns": now, "groups": {}, "why": "torch.distributed is not in use here"}
    import torch.distributed as dist

    if not dist.is_initialized():
        return {"recorder": None, "now_ns": now, "groups": {}, "why": "no process group on this rank"}
    if _python is not None:
        return {"recorder": "python", "now_ns": now, "groups": _python_groups(last)}
    raw = _torch_dump()
    if raw is None:
        return {"recorder": None, "now_ns": now, "groups": {},
                "why": f"the group was made without a recorder ({BUFFER_ENV} unset); make it again with "
                       f"setup_torch_distributed(procs)"}
    return {"recorder": "torch", "now_ns": now, "groups": _torch_groups(raw, last)}


def _torch_groups(raw: dict, last: int) -> dict:
    groups: dict = {}
    names = {}
    for e in raw.get("entries", []):
        pg = e.get("process_group") or ["0", "default_pg"]
        pg_id, name = str(pg[0]), str(pg[1] if len(pg) > 1 else pg[0])
        names[pg_id] = name
        g = groups.setdefault(name, {"entries": []})
        g["entries"].append({
            "seq": e.get("collective_seq_id", 0), "op": str(e.get("profiling_name", "")).split(":")[-1],
            "sizes": e.get("input_sizes", []), "dtype": (e.get("input_dtypes") or [""])[0],
            "group": name, "started_ns": e.get("time_created_ns"), "state": e.get("state", "")})
    for pg_id, status in (raw.get("pg_status") or {}).items():
        name = names.get(str(pg_id), "default_pg" if str(pg_id) == "0" else str(pg_id))
        g = groups.setdefault(name, {"entries": []})
        g["last_enqueued"] = int(status.get("last_enqueued_collective", -1))
        g["last_completed"] = int(status.get("last_completed_collective", -1))
    for g in groups.values():
        g["entries"] = g["entries"][-last:]
    return groups


def _python_groups(last: int) -> dict:
    groups: dict = {}
    with _lock:
        entries = list(_python or ())
    for e in entries:
        g = groups.setdefault(e["group"], {"entries": [], "last_enqueued": -1, "last_completed": -1})
        g["entries"].append(dict(e))
        g["last_enqueued"] = e["seq"]
        if e["ended_ns"] is not None:
            g["last_completed"] = max(g["last_completed"], e["seq"])
    for g in groups.values():
        g["entries"] = g["entries"][-last:]
    return groups
