"""What a controller tells its template about each rank to fork: a ``LaunchConfig``.

Built by the controller (``launcher``), carried by the template (``template/server.py``) and
read by the rank it forks (``rank.run_rank``).  Plain data with one wire encoding; it never
touches the process that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..context import MeshRef
from ..wire.curve import CurveKeys


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a forked rank needs to build its runtime and reach its owner.

    >>> ref = MeshRef("m1", "gpus", (("gpus", 1),), ("ipc:///r/m1.0",), "ipc:///r/c", ("h",))
    >>> cfg = LaunchConfig(b"k" * 32, "/r", "ipc:///r/c", 0, ref, ("/src",), "/src", {}, 8)
    >>> LaunchConfig.from_wire(cfg.to_wire()) == cfg
    True
    >>> cfg = LaunchConfig(b"k" * 32, "/r", "ipc:///r/c", 0, ref, (), "/", {}, 8, bootstrap=b"fn",
    ...                    job_ports={"controllers": ("ipc:///r/c", 3)})
    >>> LaunchConfig.from_wire(cfg.to_wire()) == cfg
    True
    >>> cfg = LaunchConfig(b"k" * 32, "/r", "ipc:///r/c", 0, ref, (), "/", {}, 8, python="/venv/bin/python",
    ...                    forwards={"tcp://10.0.0.3:6000": "tcp://10.0.0.4:7000"})
    >>> LaunchConfig.from_wire(cfg.to_wire()) == cfg
    True
    >>> cfg = LaunchConfig(b"k" * 32, "/r", "tcp://10.0.0.2:5000", 0, ref, (), "/", {}, 8,
    ...                    curve=CurveKeys(b"a" * 40, b"b" * 40, b"c" * 40, b"d" * 40), address="tcp://10.0.0.3:6000")
    >>> LaunchConfig.from_wire(cfg.to_wire()) == cfg
    True
    """

    key: bytes  # the job's signing key; reaches the rank over the socketpair only
    rundir: str  # where the job's inbox sockets live
    owner: str  # inbox address of the spawning process, which supervises the rank
    rank: int
    mesh: MeshRef
    sys_path: tuple  # the controller's sys.path, so the rank imports what it can
    cwd: str
    env: dict  # set in the rank's environment before its runtime starts
    fanout: int  # children per node when a call is forwarded down a tree of ranks
    cleanup_dirs: tuple = field(default=())  # the template removes these when it ends
    bootstrap: bytes | None = None  # a pickled function the rank runs before it says hello
    job_ports: dict = field(default_factory=dict)  # name -> (address, port id), job-wide ports
    curve: CurveKeys | None = None  # the job's Curve keys: for TCP links (ranks on other hosts)
    address: str | None = None  # where the rank's inbox listens, when not ipc under rundir (TCP)
    python: str | None = None  # the interpreter the spawner asked for; the rank's own procs start with it
    forwards: dict = field(default_factory=dict)  # old address -> new, of ranks moved to other hosts

    def to_wire(self) -> dict:
        """A msgpack-friendly dict (``key`` stays bytes: msgpack carries it, JSON would not)."""
        return {
            "key": self.key, "rundir": self.rundir, "owner": self.owner, "rank": self.rank,
            "mesh": self.mesh.to_wire(), "sys_path": list(self.sys_path), "cwd": self.cwd,
            "env": dict(self.env), "fanout": self.fanout,
            "cleanup_dirs": list(self.cleanup_dirs), "bootstrap": self.bootstrap,
            "job_ports": {k: list(v) for k, v in self.job_ports.items()},
            "curve": self.curve.to_wire() if self.curve is not None else None, "address": self.address,
            "python": self.python, "forwards": dict(self.forwards),
        }

    @classmethod
    def from_wire(cls, d: dict) -> LaunchConfig:
        return cls(
            key=d["key"], rundir=d["rundir"], owner=d["owner"], rank=d["rank"],
            mesh=MeshRef.from_wire(d["mesh"]), sys_path=tuple(d["sys_path"]), cwd=d["cwd"],
            env=dict(d.get("env") or {}), fanout=d["fanout"],
            cleanup_dirs=tuple(d.get("cleanup_dirs") or ()), bootstrap=d.get("bootstrap"),
            job_ports={k: tuple(v) for k, v in (d.get("job_ports") or {}).items()},
            curve=CurveKeys.from_wire(d["curve"]) if d.get("curve") else None, address=d.get("address"),
            python=d.get("python"), forwards=dict(d.get("forwards") or {}),
        )
