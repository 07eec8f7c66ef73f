"""What every job has: a specification, a state of host meshes, and a way to end it.

``state()`` applies the job if needed (starts agents, allocates nodes) and returns a
``JobState`` whose attributes are the job's named ``HostMesh`` objects.  ``dump(path)`` saves
what a new kernel needs to reconnect (``job_load(path)``): the hosts, and the allocation, but
never a key; reconnecting starts fresh agents on the same hosts.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref
from abc import ABC, abstractmethod

from ..actor.host_mesh import HostMesh, this_host

_KINDS: dict[str, type[JobTrait]] = {}  # dumped "kind" -> job class, filled as job classes are defined
_running: weakref.WeakValueDictionary[int, JobTrait] = weakref.WeakValueDictionary()  # by when applied
_applied = itertools.count()


def running_jobs() -> list[JobTrait]:
    """This process's jobs from ``apply()`` to ``kill()``, oldest first, however they were made
    (a kernel lists and ends the ones a cell made with the API, beside its ``%mesh`` jobs).

    Example::

        job = SSHJob(python_exe="python3").add_mesh("workers", ["h1", "h2"])
        procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
        assert running_jobs() == [job]
        job.kill()
        assert running_jobs() == []
    """
    return [job for _n, job in sorted(_running.items()) if job.active]


class JobState:
    """The host meshes of a running job, by name: ``job.state().trainers``.

    Example::

        state = job.state()
        procs = state.trainers.spawn_procs(per_host={"gpus": 4})
    """

    def __init__(self, hosts: dict[str, HostMesh]):
        self._hosts = dict(hosts)

    def __getattr__(self, name: str) -> HostMesh:
        try:
            return self.__dict__["_hosts"][name]
        except KeyError:
            names = ", ".join(sorted(self.__dict__.get("_hosts", {}))) or "none"
            raise AttributeError(f"this job has no mesh {name!r}; its meshes: {names}") from None

    def __iter__(self):
        return iter(self._hosts.items())

    def __repr__(self) -> str:
        return f"JobState({', '.join(f'{k}={v!r}' for k, v in self._hosts.items())})"


class JobTrait(ABC):
    """A job: ``apply()`` creates it (a no-op once running), ``state()`` returns its host
    meshes, ``kill()`` ends it and frees what it holds, ``dump``/``job_load`` reconnect.

    Example::

        job = SlurmJob(meshes={"trainers": 2}, partition="gpu")
        job.apply()
        procs = job.state().trainers.spawn_procs(per_host={"gpus": 4})
        job.kill()
    """

    kind = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.kind:
            _KINDS[cls.kind] = cls

    def __init__(self) -> None:
        self._running = False

    @property
    def active(self) -> bool:
        """Whether ``apply()`` ran and ``kill()`` has not."""
        return self._running

    def apply(self) -> None:
        if not self._running:
            self._create()
            self._running = True
            _running[next(_applied)] = self

    def state(self) -> JobState:
        self.apply()
        return JobState(self._host_meshes())

    def kill(self) -> None:
        """End every agent and rank of the job and free its hosts (scancel, for Slurm); the
        history its hosts wrote is copied home first (``monarch_kernel.history``)."""
        if self._running:
            from ..history import copy_home

            copy_home()
        self._kill()
        self._running = False
        for n in [n for n, job in _running.items() if job is self]:
            _running.pop(n, None)

    def release(self) -> None:
        """Let go of the hosts: an attached job's workers end their ranks and wait for the
        next controller (``AttachJob``); a job that started its hosts' agents ends, as with
        ``kill()``."""
        self.kill()

    def routes(self) -> dict[str, list[str]]:
        """How another process of this user reaches hosts that only this job's ssh connections
        reach (out of cluster): none, unless the job has such hosts (``SSHJob``)."""
        return {}

    def spec(self) -> dict:
        """The job as plain data (``job_from_spec`` builds it again; no secret is in it)."""
        return dict(self._spec(), kind=self.kind)

    def dump(self, path: str) -> None:
        """Save what ``job_load(path)`` needs to reconnect (no secret is written)."""
        spec = self.spec()
        tmp = f"{path}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(spec, f, indent=1)
        os.replace(tmp, path)

    @abstractmethod
    def _create(self) -> None: ...

    @abstractmethod
    def _host_meshes(self) -> dict[str, HostMesh]: ...

    @abstractmethod
    def _kill(self) -> None: ...

    @abstractmethod
    def _spec(self) -> dict: ...

    @classmethod
    @abstractmethod
    def _from_spec(cls, spec: dict) -> JobTrait: ...


class LocalJob(JobTrait):
    """This machine, behind the job interface: ``LocalJob(("workers",)).state().workers`` is
    ``this_host()``.

    Example::

        job = LocalJob(("workers",))
        procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
    """

    kind = "local"

    def __init__(self, hosts=("hosts",)):
        super().__init__()
        self._names = tuple(hosts)

    def _create(self) -> None:
        pass

    def _host_meshes(self) -> dict[str, HostMesh]:
        return {name: this_host() for name in self._names}

    def _kill(self) -> None:
        pass  # its procs are the controller's own children; they stop with their meshes

    def _spec(self) -> dict:
        return {"meshes": list(self._names)}

    @classmethod
    def _from_spec(cls, spec: dict) -> LocalJob:
        return cls(tuple(spec.get("meshes") or ("hosts",)))


def job_load(path: str) -> JobTrait:
    """The job ``job.dump(path)`` saved; its ``state()`` reconnects to the same hosts (for
    Slurm, the same allocation) with new agents.

    Example::

        job.dump("job.json")
        # in a restarted kernel:
        procs = job_load("job.json").state().workers.spawn_procs(per_host={"gpus": 2})
    """
    try:
        with open(path) as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no job was dumped at {path!r}: save one with job.dump({path!r})") from None
    return job_from_spec(spec, where=repr(path))


def job_from_spec(spec: dict, where: str = "the spec") -> JobTrait:
    """The job ``job.spec()`` described.

    Example::

        same = job_from_spec(job.spec())
    """
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in _KINDS:
        raise ValueError(f"{where} is not a dumped job (kind {kind!r}; known: {', '.join(sorted(_KINDS))})")
    return _KINDS[kind]._from_spec(spec)
