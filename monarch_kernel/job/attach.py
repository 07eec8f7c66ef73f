"""``attach_to_workers`` and ``AttachJob``: hosts whose workers a scheduler started (``python
-m monarch_kernel.agent --listen tcp://ADDR:PORT --key-file PATH``), with Monarch's names::

    hosts = attach_to_workers(workers=["tcp://node1:29500", "tcp://node2:29500"], key="~/.mk-key")
    procs = hosts.spawn_procs(per_host={"gpus": 4})      # {"hosts": 2, "gpus": 4}
    hosts.stop()        # their ranks end; the workers wait for the next controller
    hosts.shutdown()    # ... and the workers exit (job.kill())

Unlike an ssh-started agent, a worker outlives its controller: this controller's exit ends
the ranks it started there, and the worker waits for the next one.
"""

from __future__ import annotations

import os
import time

from ..actor.host_mesh import HostMesh
from ..agent import worker_key
from ..runtime.hosting import Runtime, config
from .agents import controller_address
from .job import JobTrait
from .worker_session import WorkerSession, parse_worker

# worker address -> the running AttachJob of this process that holds it (a cell run again finds it)
_held: dict[str, AttachJob] = {}


class AttachJob(JobTrait):
    """The workers at ``workers`` (their ``--listen`` addresses, as this machine reaches
    them), as one host mesh called ``name``; ``key``: the path of the key file they hold.

    Example::

        job = AttachJob(["tcp://node1:29500", "tcp://node2:29500"], key="~/.mk-key")
        procs = job.state().hosts.spawn_procs(per_host={"gpus": 4})
        job.kill()                          # the workers exit too
    """

    kind = "attach"

    def __init__(self, workers, key, name: str = "hosts", start_timeout: float | None = None):
        super().__init__()
        if isinstance(workers, str):
            workers = [w for w in workers.split(",") if w]
        if not isinstance(workers, (list, tuple)):
            raise TypeError("workers= is a list of the workers' --listen addresses, e.g. "
                            f'workers=["tcp://node1:29500", "tcp://node2:29500"]; not {type(workers).__name__}')
        workers = list(workers)
        if not workers:
            raise ValueError('attach to at least one worker: workers=["tcp://node1:29500", ...]')
        for w in workers:
            parse_worker(w)
        twice = sorted({w for w in workers if workers.count(w) > 1})
        if twice:
            raise ValueError(f"each worker once: {', '.join(twice)} is given more than once")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"mesh names are attributes of job.state(): {name!r} is not an identifier")
        if key is None:
            raise ValueError("key= is the path of the workers' key file (python -m monarch_kernel key new PATH)")
        self.workers = workers
        self.key_file = os.path.expanduser(os.fspath(key))
        if os.path.isdir(self.key_file):
            raise IsADirectoryError(f"key={key!r} is a folder: give the key file itself, e.g. "
                                    f"key={os.path.join(str(key), 'mk.key')!r} (make one with  python -m "
                                    f"monarch_kernel key new PATH)")
        # a key others may read is refused here, before any connection
        self._key = worker_key.read_key_file(self.key_file)
        self.name = name
        self.start_timeout = start_timeout
        self._sessions: list[WorkerSession] = []

    def same_as(self, other: AttachJob) -> bool:
        """Whether ``other`` asks for what this running job holds (the same workers, key
        file and name), every worker still attached: a cell run again reuses this job."""
        return (self.active and self.workers == other.workers and self.key_file == other.key_file
                and self.name == other.name and all(not s.ended.is_set() for s in self._sessions))

    def _create(self) -> None:
        # This process's earlier jobs on these workers let go of them first (their ranks end):
        # a cell run again takes its own workers back rather than finding them busy.
        for job in {id(j): j for w in self.workers if (j := _held.get(w)) is not None and j is not self}.values():
            job.release()
        rt = Runtime.current()
        controller = controller_address(rt, parse_worker(self.workers[0])[0])
        deadline = time.monotonic() + (self.start_timeout or config.spawn_timeout())
        sessions = [WorkerSession(rt, w, self._key) for w in self.workers]
        opened = []
        try:
            for s in sessions:
                s.open(controller, deadline)
                opened.append(s)
            for s in sessions:
                s.wait_up(deadline)
        except BaseException:
            for s in opened:
                s.end(shutdown=False)
            raise
        self._sessions = sessions
        for w in self.workers:
            _held[w] = self

    def _host_meshes(self) -> dict[str, HostMesh]:
        return {self.name: HostMesh(agents=[s.link for s in self._sessions], job=self)}

    def _kill(self) -> None:
        self._end(shutdown=True)

    def release(self) -> None:
        """End every rank on the workers and let go of them: they wait for the next controller."""
        self._end(shutdown=False)
        self._running = False

    def _end(self, shutdown: bool) -> None:
        sessions, self._sessions = self._sessions, []
        for w in self.workers:
            if _held.get(w) is self:
                del _held[w]
        for s in sessions:
            s.end(shutdown)

    def _spec(self) -> dict:
        return {"workers": list(self.workers), "key_file": self.key_file, "name": self.name}

    @classmethod
    def _from_spec(cls, spec: dict) -> AttachJob:
        return cls(spec["workers"], spec["key_file"], spec.get("name") or "hosts")


def attach_to_workers(*, workers, key=None, name: str | None = None, start_timeout: float | None = None,
                      ca=None, private_key=None) -> HostMesh:
    """A ``HostMesh`` (dim ``hosts``) over the workers at ``workers`` (``tcp://HOST:PORT``,
    as each worker's ``--listen``), which hold the key in file ``key`` (Monarch's name; a key
    file stands for Monarch's ``ca=`` and ``private_key=``).  Returns once every worker's
    agent has connected; ``.stop()`` lets go of the workers, ``.shutdown()`` ends them.
    Called again in this process (a cell run again), it reuses the attachment to the same
    workers, key and name, with their ranks; otherwise it takes its workers back first.

    Example::

        hosts = attach_to_workers(workers=["tcp://node1:29500", "tcp://node2:29500"], key="~/.mk-key")
        procs = hosts.spawn_procs(per_host={"gpus": 4})
    """
    if key is None:
        raise TypeError(worker_key.no_key("attach_to_workers(workers=[...], key=PATH)", ca, private_key))
    job = AttachJob(workers, key, name=name or "hosts", start_timeout=start_timeout)
    held = _held.get(job.workers[0])
    if held is not None and held.same_as(job):
        job = held
    return getattr(job.state(), job.name)
