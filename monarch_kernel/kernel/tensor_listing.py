"""``%mesh tensors``: the live distributed tensors of each mesh, each named by the notebook
variable that holds it (``w``, ``model.weight``, ``losses[3]``, ``model.weight.grad``), and
the rest, which no variable holds (intermediate results, autograd's saved tensors, an
optimizer's state), counted in groups: ``22 scalar temporaries, 88 bytes per rank``.

Names are found by looking, a few levels deep and within a budget, through the user's
namespace: variables, the items of lists, tuples and dicts, and the parameters, buffers and
gradients of torch modules.  Runs in the kernel; it only reads.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

from ..tensors.controller.registry import describe, live_handles

HIDDEN = {"In", "Out", "exit", "quit", "get_ipython"}  # IPython's own names, not the user's
DEPTH = 2  # containers looked into: ``stages[0].weight`` is found, ``a[0][1][2]`` is not
ITEMS = 10_000  # items looked at in one container
BUDGET = 200_000  # objects looked at in all
NAME_WIDTH = 28  # the names' column, at most


def tensor_lines(user_ns: dict) -> list[str]:
    """What ``%mesh tensors`` prints."""
    meshes = live_handles()
    if not meshes:
        return ["no distributed tensors; make some inside  with procs.activate():"]
    wanted = {id(t): t for handles in meshes.values() for t in handles}
    names = find_names(user_ns, wanted)
    out = []
    for mesh, handles in meshes.items():
        rows = [(t, describe(t)) for t in handles]
        total = sum(row["bytes"] for _t, row in rows)
        out.append(f"{mesh}: {len(rows)} tensor{'s' if len(rows) != 1 else ''}, {total:,} bytes per rank")
        out.extend(f"  {line}" for line in _mesh_lines(rows, names))
    return out


def _what(row: dict) -> str:
    return f"{row['shape']} {row['dtype']} on {row['device']}"


def _mesh_lines(rows: list[tuple], names: dict[int, list[str]]) -> list[str]:
    order = {key: i for i, key in enumerate(names)}  # the order the variables were found in
    named = sorted((order[id(t)], " = ".join(names[id(t)]), row) for t, row in rows if id(t) in names)
    named_lines = _ranges([(name, row) for _i, name, row in named])
    width = min(NAME_WIDTH, max((len(name) for name, _text in named_lines), default=0))
    lines = [f"{name:<{width}}  {text}" for name, text in named_lines]
    groups: dict[str, list[dict]] = {}
    for t, row in rows:
        if id(t) not in names:
            groups.setdefault("scalar" if not row["shape"] else _what(row), []).append(row)
    scalars = groups.pop("scalar", [])
    for what, members in groups.items():
        n, size = len(members), sum(r["bytes"] for r in members)
        lines.append(f"{n} {'temporary' if n == 1 else 'temporaries'} {what}: {size:,} bytes per rank")
    if scalars:
        n, size = len(scalars), sum(r["bytes"] for r in scalars)
        lines.append(f"{n} scalar {'temporary' if n == 1 else 'temporaries'}, {size:,} bytes per rank")
    return lines


_ITEM = re.compile(r"^(?P<base>.+)\[(?P<i>\d+)\]$")


def _ranges(named: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """(name, text) per row, items of one list that follow each other with the same shape
    as one row: ``losses[0-19]  20 × [] float32 on cpu: 80 bytes per rank``."""
    out: list[tuple[str, str]] = []
    run: list[tuple[str, int, dict]] = []  # (base, index, row) of the items being joined

    def close() -> None:
        if not run:
            return
        base, first, row = run[0]
        if len(run) == 1:
            out.append((f"{base}[{first}]", f"{_what(row)}: {row['bytes']:,} bytes per rank"))
        else:
            size = sum(r["bytes"] for _b, _i, r in run)
            out.append((f"{base}[{first}-{run[-1][1]}]", f"{len(run)} × {_what(row)}: {size:,} bytes per rank"))
        run.clear()

    for name, row in named:
        m = _ITEM.match(name)
        if m and run and m["base"] == run[-1][0] and int(m["i"]) == run[-1][1] + 1 and _what(row) == _what(run[-1][2]):
            run.append((m["base"], int(m["i"]), row))
            continue
        close()
        if m:
            run.append((m["base"], int(m["i"]), row))
        else:
            out.append((name, f"{_what(row)}: {row['bytes']:,} bytes per rank"))
    close()
    return out


def find_names(user_ns: dict, wanted: dict[int, object]) -> dict[int, list[str]]:
    """``{id(tensor): [its names]}`` for the ``wanted`` tensors the user's variables hold, in
    the order they were found (the namespace's), each tensor's shortest name first."""
    found: dict[int, list[str]] = {}
    for seen, (path, obj) in enumerate(_walk(user_ns)):
        if seen >= BUDGET:
            break
        if id(obj) in wanted:
            paths = found.setdefault(id(obj), [])
            if path not in paths:
                paths.append(path)
    for paths in found.values():
        paths.sort(key=lambda p: p.count(".") + p.count("["))  # stable: found first among as short
    return found


def _walk(user_ns: dict) -> Iterator[tuple[str, object]]:
    """(name, object) for the user's variables and what they hold, ``DEPTH`` levels down."""
    for name, value in list(user_ns.items()):
        if name.startswith("_") or name in HIDDEN or type(value).__name__ == "module":
            continue
        yield from _inside(name, value, 0)


def _inside(path: str, obj, depth: int) -> Iterator[tuple[str, object]]:
    yield path, obj
    grad = _grad(obj)
    if grad is not None:
        yield f"{path}.grad", grad
    if depth >= DEPTH:
        return
    if type(obj) in (list, tuple):
        for i, x in enumerate(obj[:ITEMS]):
            yield from _inside(f"{path}[{i}]", x, depth + 1)
    elif type(obj) is dict:
        for i, (k, v) in enumerate(obj.items()):
            if i >= ITEMS:
                break
            yield from _inside(f"{path}[{k!r}]", v, depth + 1)
    elif _is_module(obj):
        for kind in ("named_parameters", "named_buffers"):
            for i, (n, t) in enumerate(getattr(obj, kind)()):
                if i >= ITEMS:
                    break
                yield from _inside(f"{path}.{n}", t, DEPTH)


def _is_module(obj) -> bool:
    torch = sys.modules.get("torch")  # a namespace without torch holds no module
    return torch is not None and isinstance(obj, torch.nn.Module)


def _grad(obj):
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    try:
        return obj.grad
    except Exception:  # noqa: BLE001  (a tensor subclass whose .grad raises has none to name)
        return None
