"""Reading what Slurm says about a job: ``squeue --json`` (22.05's layout and 23.x/24.x's)
and host lists (``"gpu[01-04,07],login1"``), with no other Slurm command and no Slurm library.

Pure functions over text and parsed JSON, tested on saved samples (tests/fixtures); it never runs
a command itself.  Unknown fields are ignored, so a newer layout only breaks what it renames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# States after which a job holds no node any more (COMPLETING still has processes to kill).
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
BASE_STATES = ENDED | {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING",
                       "STAGE_OUT", "SIGNALING", "STOPPED", "RESV_DEL_HOLD", "REQUEUE_FED", "REQUEUE_HOLD"}


@dataclass(frozen=True)
class SqueueJob:
    """One job as squeue lists it: ``state`` is its base state (``"RUNNING"``), ``nodes``
    its allocated nodes in Slurm's order (empty while pending), ``reason`` why it waits."""

    job_id: str
    state: str
    nodes: tuple[str, ...] = ()
    partition: str = ""
    reason: str = ""
    name: str = ""

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as names, in order: ``"n[1-3,5],gpu[01-02]"`` ->
    ``['n1', 'n2', 'n3', 'n5', 'gpu01', 'gpu02']``.  Ranges keep the lower bound's zero
    padding; several bracket groups in one name expand as their product (``r[1-2]n[1-2]``)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            names.extend(_expand_one(item, text))
    return names


def _split_top(text: str) -> list[str]:
    """Split at the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


_GROUP = re.compile(r"\[([^\[\]]*)\]")


def _expand_one(item: str, whole: str) -> list[str]:
    m = _GROUP.search(item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"unbalanced brackets in the Slurm host list {whole!r}")
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for value in _expand_ranges(m.group(1), whole):
        out.extend(_expand_one(head + value + tail, whole))
    return out


def _expand_ranges(spec: str, whole: str) -> list[str]:
    values = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in the Slurm host list {whole!r}")
        if not sep:
            values.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"descending range {part!r} in the Slurm host list {whole!r}")
        width = len(lo)
        values.extend(str(v).zfill(width) for v in range(a, b + 1))
    return values


def number(value) -> int | None:
    """A count as squeue writes it: ``8`` (22.05) or ``{"set": true, "number": 8}`` (23.x+);
    None when unset or infinite."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        n = value.get("number")
        return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def base_state(value) -> str:
    """``"RUNNING"`` (22.05) or ``["RUNNING"]`` / ``["PENDING", "REQUEUED"]`` (23.x+): the base
    state (a list holds it with flags; the first name that is a base state wins)."""
    if isinstance(value, str):
        return value.upper()
    if isinstance(value, list):
        names = [str(v).upper() for v in value]
        for name in names:
            if name in BASE_STATES:
                return name
        return names[0] if names else "UNKNOWN"
    return "UNKNOWN"


def allocated_nodes(job: dict) -> list[str]:
    """The job's nodes, in Slurm's order, from whichever field this layout has."""
    res = job.get("job_resources") or {}
    if isinstance(res, dict):
        nodes = res.get("nodes")
        if isinstance(nodes, dict):  # 24.05+: {"count", "list": "n[1-2]", "allocation": [{"name"}]}
            names = [a["name"] for a in nodes.get("allocation") or () if isinstance(a, dict) and a.get("name")]
            if names:
                return names
            if isinstance(nodes.get("list"), str) and nodes["list"]:
                return expand_hostlist(nodes["list"])
        listed = res.get("allocated_nodes")
        if isinstance(listed, list):  # 22.05, 23.x: [{"nodename": "n1", ...}]
            names = [a.get("nodename") or a.get("name") for a in listed if isinstance(a, dict)]
            if names and all(names):
                return [str(n) for n in names]
        if isinstance(nodes, str) and nodes:  # 22.05: "n[1-2]"
            return expand_hostlist(nodes)
    if isinstance(job.get("nodes"), str) and job["nodes"]:
        return expand_hostlist(job["nodes"])
    return []


def parse_job(job: dict) -> SqueueJob:
    """One entry of ``squeue --json``'s ``jobs``."""
    job_id = job.get("job_id")
    job_id = number(job_id) if isinstance(job_id, dict) else job_id
    state = base_state(job.get("job_state"))
    return SqueueJob(
        job_id=str(job_id), state=state,
        nodes=tuple(allocated_nodes(job)) if state not in ("PENDING",) else (),
        partition=str(job.get("partition") or ""),
        reason=str(job.get("state_reason") or ""), name=str(job.get("name") or ""))


def find_job(data: dict, job_id: str) -> SqueueJob | None:
    """Job ``job_id`` in parsed ``squeue --json`` output, or None when it is not listed
    (22.05 may list every job whatever ``-j`` asked for, so this filters)."""
    for job in data.get("jobs") or ():
        if isinstance(job, dict):
            parsed = parse_job(job)
            if parsed.job_id == str(job_id):
                return parsed
    return None


def parse_plain(line: str, job_id: str) -> SqueueJob:
    """One line of ``squeue -h -o '%T|%N|%P|%r|%j'`` (the fallback when ``--json`` is not built in)."""
    state, nodes, partition, reason, name = (line.split("|") + [""] * 5)[:5]
    nodes = nodes.strip()
    state = state.strip().upper()
    return SqueueJob(str(job_id), state, tuple(expand_hostlist(nodes)) if nodes and state != "PENDING" else (),
                     partition.strip(), reason.strip(), name.strip())


PLAIN_FORMAT = "%T|%N|%P|%r|%j"


# Pending reasons that waiting does not cure (and "...PerJobLimit": a QOS or account cap on one job).
NEVER_RUNS = {
    "PartitionNodeLimit": "more nodes than its partition allows or has up (`sinfo -p {partition}` shows them); "
                          "ask for fewer nodes in meshes= or another partition",
    "PartitionTimeLimit": "time_limit is over the partition's MaxTime; ask for less",
    "BadConstraints": "no node matches its constraints (slurm_args, gpus_per_node, cpus_per_task, mem)",
    "InvalidAccount": "the account is not valid for this user; pass account= one `sacctmgr show assoc "
                      "user=$USER` lists",
    "InvalidQOS": "the QOS is not valid for this account; pass another qos=",
    "DependencyNeverSatisfied": "its --dependency can never be met",
}


def never_runs(reason: str) -> bool:
    """Whether a pending job's ``reason`` is one that waiting does not cure."""
    return reason in NEVER_RUNS or reason.endswith("PerJobLimit")
