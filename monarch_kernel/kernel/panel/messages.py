"""The messages of the Mesh panel's comm (``monarch_kernel.panel``), as small dataclasses
with one encode/decode pair each: what the kernel sends (``PanelState``, ``LogLines``,
``Reply``) and what the panel asks (``Request``).  Pure data: nothing here talks to a
kernel; ``labextension/src/messages.ts`` holds the same shapes on the TypeScript side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

COMM_TARGET = "monarch_kernel.panel"
PROTOCOL = 1

# What a rank's ``state`` may be, in the panel's words.
STATES = ("idle", "busy", "debugger", "pdb", "not responding", "dead")
ACTIONS = ("hello", "refresh", "interrupt", "restart", "debug", "stop", "use", "spawn", "log", "table", "stacks",
           "metrics")


class MessageError(ValueError):
    """A panel message that does not have the shape of its type."""


def _check(cls, data: Any) -> dict:
    if not isinstance(data, dict):
        raise MessageError(f"a {cls.__name__} is a JSON object; got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names - {"type"}
    if unknown:
        raise MessageError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return {k: v for k, v in data.items() if k in names}


@dataclass
class RankRow:
    """One rank as the panel shows it."""

    rank: int
    host: str
    pid: int | None
    state: str  # one of STATES
    detail: str = ""  # how it died, or where it is stopped
    cpu: float | None = None  # percent of one core since the previous update (None: remote or unknown)
    rss_mib: float | None = None
    last: str = ""  # its last output line
    stack_differs: bool = False  # the watchdog found its stacks unlike the majority's (this cell)

    @classmethod
    def decode(cls, data: Any) -> RankRow:
        return cls(**_check(cls, data))


@dataclass
class MeshRow:
    """One mesh of this kernel."""

    name: str
    ranks: int
    hosts: list[str]
    kind: str  # "local", "detached" or "job"
    job: str = ""  # the job's name, for kind "job"
    current: bool = False
    stopped: bool = False
    dead: int = 0
    log_seq: int = 0  # the newest log line's number: the log tab asks again when it grows
    rows: list[RankRow] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # ranks in each state (of STATES), all ranks
    summary: bool = False  # rows holds only the ranks that are not idle (a mesh over status.SUMMARY_OVER ranks)
    expanded: bool = False  # a panel asked for the full table (Request "table", full=True): rows holds every rank
    tensors: int = 0  # live distributed tensors of the mesh (``%mesh tensors`` lists them)
    tensor_bytes: int = 0  # ... and the bytes they hold on each rank

    @classmethod
    def decode(cls, data: Any) -> MeshRow:
        d = _check(cls, data)
        d["rows"] = [RankRow.decode(r) for r in d.get("rows", [])]
        return cls(**d)


@dataclass
class JobRow:
    """A job (ssh, slurm) this kernel started: the New mesh dialog offers it as a launcher."""

    name: str
    kind: str
    active: bool
    hosts: list[str]
    meshes: list[str]

    @classmethod
    def decode(cls, data: Any) -> JobRow:
        return cls(**_check(cls, data))


@dataclass
class PanelState:
    """Everything the panel shows of one kernel; sent whenever it changes."""

    meshes: list[MeshRow]
    jobs: list[JobRow]
    running: bool  # a cell is executing
    kernel_id: str = ""
    debug_target: str = ""  # "mesh:rank" JupyterLab's debugger points at, "" for the kernel
    protocol: int = PROTOCOL
    cell: int = 0  # cells this kernel has begun: a panel's note about "now" goes when the next one starts
    type: str = "state"

    def encode(self) -> dict:
        return asdict(self)

    @classmethod
    def decode(cls, data: Any) -> PanelState:
        d = _check(cls, data)
        d["meshes"] = [MeshRow.decode(m) for m in d.get("meshes", [])]
        d["jobs"] = [JobRow.decode(j) for j in d.get("jobs", [])]
        return cls(**d)


@dataclass
class LogLines:
    """A mesh's recent output lines, oldest first: ``[seq, rank, stream, line]`` each."""

    mesh: str
    lines: list[list]
    since: int = 0
    type: str = "log"

    def encode(self) -> dict:
        return asdict(self)

    @classmethod
    def decode(cls, data: Any) -> LogLines:
        return cls(**_check(cls, data))


@dataclass
class Metrics:
    """A mesh's samples per rank, oldest first (the panel's sparklines): ``ranks`` maps a rank
    (as a string: JSON keys) to ``{"cpu": [percent or None, ...], "rss_mib": [...]}``."""

    mesh: str
    ranks: dict[str, dict[str, list]]
    type: str = "metrics"

    def encode(self) -> dict:
        return asdict(self)

    @classmethod
    def decode(cls, data: Any) -> Metrics:
        return cls(**_check(cls, data))


@dataclass
class Reply:
    """The answer to one ``Request``: ``ok`` and a sentence to show; ``report``: a text the
    panel opens in a tab of its own (``stacks``: the grouped stacks)."""

    id: int
    ok: bool
    message: str = ""
    report: str = ""
    type: str = "reply"

    def encode(self) -> dict:
        return asdict(self)

    @classmethod
    def decode(cls, data: Any) -> Reply:
        return cls(**_check(cls, data))


@dataclass
class Request:
    """What the panel asks the kernel to do.  ``action`` is one of ``ACTIONS``; the other
    fields are that action's arguments (``spawn`` reads ``n``, ``name``, ``detach``, ``use``
    and the launcher's fields; ``table`` reads ``mesh`` and ``full``: every rank's row in each
    state from now on, or the summary again)."""

    action: str
    id: int = 0
    mesh: str = ""
    rank: int | None = None
    ranks: list[int] | None = None
    since: int = 0
    n: int = 0
    name: str = ""
    detach: bool = False
    launcher: str = "local"  # local | ssh | slurm | a running job's name
    hosts: str = ""
    ssh_args: str = ""
    nodes: int = 0
    partition: str = ""
    time: str = ""
    account: str = ""
    full: bool = True
    use: bool = False  # spawn: make the new mesh current (else it is only when no mesh is)

    def encode(self) -> dict:
        return {**asdict(self), "type": "request"}

    @classmethod
    def decode(cls, data: Any) -> Request:
        d = _check(cls, data)
        action = d.get("action")
        if action not in ACTIONS:
            raise MessageError(f"unknown panel action {action!r:.40}; one of {', '.join(ACTIONS)}")
        for f in fields(cls):
            if f.name not in d:
                continue
            v, kind = d[f.name], _REQUEST_TYPES[str(f.type)]
            if kind == "list[int] | None":
                ok = v is None or (isinstance(v, list) and all(type(x) is int for x in v))
            elif kind == "int | None":
                ok = v is None or type(v) is int
            else:
                ok = type(v) is {"str": str, "int": int, "bool": bool}[kind]
            if not ok:
                raise MessageError(f"{f.name} is {_SAID[kind]}; got {type(v).__name__}")
        return cls(**d)


# Request's annotations (strings here) and how a wrong one is said to the panel.
_REQUEST_TYPES = {t: t for t in ("str", "int", "bool", "int | None", "list[int] | None")}
_SAID = {"str": "a string", "int": "a number", "bool": "true or false", "int | None": "a number or null",
         "list[int] | None": "a list of numbers or null"}
