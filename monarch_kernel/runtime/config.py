"""Reading the settings in force, and giving them values for a process.

What each setting is lives in ``settings.py`` (``SETTINGS``).  A setting with an environment
variable is read from it at each use (so a cell's ``%env`` takes effect), unless a value was
given with ``set()`` (the kernel does this for its ``MeshKernel`` traitlets); a constant
(``env`` None) is fixed.  ``python -m monarch_kernel settings --markdown`` prints the documentation's
tables.  The lowest layer: it imports nothing of the project above runtime/.
"""

from __future__ import annotations

import os
from typing import Any

from .settings import SETTINGS as SETTINGS  # re-exported: config.SETTINGS is where callers look
from .settings import Setting as Setting

_given: dict[str, Any] = {}  # values given with set(), by name


def setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"no setting named {name!r}; the settings are {', '.join(SETTINGS)}") from None


def value(s: Setting) -> Any:
    """The value of ``s`` in force: one given with ``set()``, else the environment's, else the default."""
    if s.name in _given:
        return _given[s.name]
    raw = os.environ.get(s.env) if s.env else None
    return s.default if raw is None else s.parse(raw)


def get(name: str) -> Any:
    """The value of setting ``name`` in force (``get("heartbeat_timeout")`` -> 10.0)."""
    return value(setting(name))


def set(name: str, value: Any) -> None:
    """Give setting ``name`` a value for this process, ahead of its environment variable;
    ``None`` takes it back.  The ranks this process spawns get it too (``exported_env()``)."""
    s = setting(name)
    if s.env is None:
        raise ValueError(f"{name} is a constant of the code ({s.used_in}), not a setting; change it there")
    if value is None:
        _given.pop(name, None)
    else:
        _given[name] = s.parse(str(value)) if isinstance(value, str) else s.type(value)


def given(name: str) -> Any:
    """The value given to setting ``name`` with ``set()``, or None: what to give back after
    a temporary ``set()``."""
    return _given.get(setting(name).name)


def exported_env() -> dict[str, str]:
    """The values given with ``set()``, as environment variables: spawned ranks (and what they
    spawn) see what this process sees.  A spawn's own ``env=`` wins over them."""
    return {s.env: ("1" if _given[n] else "0") if s.type is bool else str(_given[n])
            for n, s in SETTINGS.items() if n in _given and s.env}


def env_name(name: str) -> str:
    """The environment variable of setting ``name`` (``env_name("bind_address")`` -> ``MONARCH_KERNEL_BIND``)."""
    env = setting(name).env
    assert env is not None, f"{name} is a constant of the code"
    return env


def kernel_settings() -> list[Setting]:
    """The settings that are also ``MeshKernel`` traitlets: those a controller reads."""
    return [s for s in SETTINGS.values() if s.kernel]


def seconds(name: str) -> float:
    """A timing constant, in seconds (``seconds("agent_beat")`` -> 0.5)."""
    s = setting(name)
    assert s.unit == "s" and s.env is None, f"{name} is not a timing constant"
    return s.default


# Typed accessors of the settings, for the code that reads them.
def fanout() -> int:
    return get("fanout")


def max_frame() -> int:
    return get("max_frame")


def max_wire_frame() -> int:
    return get("max_wire_frame")


def spawn_timeout() -> float:
    return get("spawn_timeout")


def check_limits() -> bool:
    return get("check_limits")


def rank_memory() -> int:
    return get("rank_memory")


def heartbeat_timeout() -> float:
    return get("heartbeat_timeout")


def max_line() -> int:
    return get("max_line")


def send_queue() -> int:
    return get("send_queue")


def send_block() -> float:
    return get("send_block")


def reach_timeout() -> float:
    return get("reach_timeout")


def bind_address() -> str | None:
    return get("bind_address")


def stacks_py_spy() -> bool:
    return get("stacks_py_spy")


def strict() -> bool:
    return get("strict")


def native_wire() -> bool:
    return value(SETTINGS["native_wire"])


def data_transport() -> str | None:
    return get("data_transport")


def data_bind_address() -> str | None:
    return get("data_bind")


def data_handshake_timeout() -> float:
    return get("data_handshake_timeout")


def tcp_streams() -> int:
    return get("tcp_streams")


def data_copy_threads() -> int:
    return get("data_copy_threads")


def collective_timeout() -> float:
    return get("collective_timeout")


def tensor_transfer() -> str | None:
    return get("tensor_transfer")


def netns() -> str | None:
    return get("netns")


def ib_device() -> tuple[str | None, int, int]:
    """(device, port, GID index) for ``ibverbs``."""
    return get("ib_device"), get("ib_port"), get("ib_gid_index")


def markdown() -> str:
    """The documentation's two tables (docs/reference/settings.md): the settings, then the timing constants."""
    rows = ["| variable | `MeshKernel` trait | type | default | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{s.env}` | {f'`{s.name}`' if s.kernel else ''} | {s.type.__name__}{f' ({s.unit})' if s.unit else ''}"
             f" | {s.default_text()} | {s.help} |" for s in SETTINGS.values() if s.env]
    rows += ["", "| constant | seconds | used in | meaning |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default_text()} | `{s.used_in}` | {s.help} |"
             for s in SETTINGS.values() if not s.env]
    return "\n".join(rows) + "\n"

