"""The launcher: starts the ranks of the meshes this process spawns, and hears them come up,
beat, write and exit.

It owns the templates that fork local ranks, the links to the agents of this process's
hosts, and the ``OwnedMesh`` record of each mesh (in ``meshes``, the runtime's table); it
restarts, kills and stops ranks.  A death is learnt from the process exit (the template reaps
its children and says so), never by polling; what a death means is the supervision policy's
to decide (``supervision.on_death``).

It is given its collaborators (the IO thread, network, outbox, receiver, supervision policy...)
and what each rank inherits from this process (``Inherited``), never the runtime itself.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import config
from ..completion import Completion
from ..context import MeshRef, current_actor
from ..errors import ActorError
from ..failure import DeathInfo
from ..limits import raise_nofile_limit
from ..wire.envelope import Kind, Part, Status
from . import agent_channel
from .agent_link import AgentLink
from .host_messages import MalformedMessage, RankHello
from .launch_config import LaunchConfig
from .owned_mesh import OwnedMesh
from .rank_output import LineReader
from .rank_remains import kill_rank, remove_inboxes
from .template_client import TemplateClient

if TYPE_CHECKING:
    from ..wire.segments import Segments

STOP_GRACE_S = config.seconds("stop_grace")
EXIT_DRAIN_S = config.seconds("exit_drain")


@dataclass(frozen=True)
class Inherited:
    """What this process hands each rank it launches (and each host's agent); the runtime
    fills the two tables in place (``warm``, ``publish_port``)."""
    key: bytes
    rundir: str
    address: str  # this process's main inbox, on ``host``
    host: str
    warm_modules: list  # what templates import before forking
    job_ports: dict  # name -> (address, port id)
    segments: Segments | None  # the shared-memory segments (their ``dir``)
    owns_rundir: Callable[[], bool]  # the root controller's: set after the runtime is made


class Launcher:
    """Held by the runtime as ``rt.launcher``.  Its public methods may be called from any
    thread (they hand their work to the IO thread); the ``on_*`` events arrive on it."""

    def __init__(self, *, io, network, outbox, receiver, inbox, meshes: dict, drops, hooks, supervision,
                 inherited: Inherited):
        self.io, self.network, self.outbox, self.receiver, self.inbox = io, network, outbox, receiver, inbox
        self.drops, self.hooks, self.supervision, self.inherited = drops, hooks, supervision, inherited
        self.meshes = meshes  # mesh id -> OwnedMesh: the runtime's table, filled here
        self.templates: dict[str, TemplateClient] = {}  # source id (python#n) -> its template
        self.pid_index: dict[tuple[str, int], tuple[OwnedMesh, int]] = {}  # (source, pid) -> rank
        self.links: dict[str, AgentLink] = {}  # agents of this process's hosts, by link id
        self._beating = False
        self._count = 0  # templates started
        # The interpreter procs start with unless the spawn names one: in a rank, its own
        # spawner's (``HostMesh.with_python_executable``), so that its procs start through it too.
        self.python: str | None = None
        # Ranks one template may hold: 3 pipes each, within the open-files limit it will have.
        self.per_template = max(16, (raise_nofile_limit() - 100) // 3)

    @property
    def template(self) -> TemplateClient | None:
        """A template running this process's own interpreter, once started."""
        return next((t for t in self.templates.values() if t.python == sys.executable), None)

    # ------------------------------------------------------------ spawning

    def spawn(self, name: str, dims: tuple, env: dict | None = None, *, bootstrap: bytes | None = None,
              python: str | None = None, hosts: list | None = None, check: bool = False) -> OwnedMesh:
        """Launch a mesh's ranks; ``bootstrap`` (pickled) runs on each before it says hello,
        ``python`` is the interpreter they run (default: ``self.python``, else this one's).  ``hosts``: AgentLinks
        (``add_host``) the ranks are spread over, in order, the same number on each; without
        them every rank is forked here.  ``check``: each host first sees that it holds its ranks
        (``capacity.host_shortfall``), else ``NoRoom`` is raised before anything is forked."""
        me = self.inherited
        mesh_id = "m" + secrets.token_hex(4)
        n = 1
        for _, size in dims:
            n *= size
        links = None
        if hosts:
            per = n // len(hosts)
            ports = self._reserve(hosts, per, check)  # first: a host without room refuses before lists of n
            links = [hosts[r // per] for r in range(n)]
            addresses = tuple(f"tcp://{links[r].ip}:{ports[links[r].id][r % per]}" for r in range(n))
            ref = MeshRef(mesh_id, name, dims, addresses, self.network.net_address, tuple(link.host for link in links))
        else:
            addresses = tuple(f"ipc://{me.rundir}/{mesh_id}.{r}" for r in range(n))
            ref = MeshRef(mesh_id, name, dims, addresses, me.address, (me.host,) * n)
        om = OwnedMesh(ref, current_actor.get())
        om.bootstrap, om.python, om.links = bootstrap, python or self.python or sys.executable, links
        self.meshes[mesh_id] = om
        if n == 0:
            om.ready.set_result(True)
            om.exited.set_result(True)
            return om
        try:
            self.io.run(self._launch, om, dict(env or {}))
        except BaseException:
            self.meshes.pop(mesh_id, None)  # nothing was launched (the interpreter would not start)
            raise
        return om

    def _reserve(self, hosts: list, per: int, check: bool) -> dict[str, list[int]]:
        """Ports for ``per`` ranks on each host, asked of every agent at once (each sees
        first that it has room, with ``check``)."""
        cost = config.rank_memory()
        asked = {link.id: link.reserve_async(per, check, cost) for link in {link.id: link for link in hosts}.values()}
        deadline = time.monotonic() + config.spawn_timeout()
        ports = {}
        for link in hosts:
            got = asked[link.id]
            if not got.wait(max(0.0, deadline - time.monotonic())):
                raise ConnectionError(f"the agent on {link.host} did not answer within {config.spawn_timeout():g} s")
            if got.error() is not None:
                raise got.error()
            ports[link.id] = list(got.result())
        return ports

    def source(self, om: OwnedMesh, rank: int) -> str:
        """What forked ``rank``: a local template or a host's agent (its id)."""
        if om.links is not None:
            return om.links[rank].id
        return om.sources[rank] or om.python

    def _forker(self, om: OwnedMesh, rank: int) -> tuple[str, TemplateClient | AgentLink]:
        """Who forks ``rank``, and its source id: the host's agent, or a local template of the
        mesh's interpreter with room (one holds 3 pipes per rank: past its open-files limit
        the next template takes over, so a limit of 1,024 still fits thousands of ranks)."""
        if om.links is not None:
            return om.links[rank].id, om.links[rank]
        python = om.python
        for source, template in self.templates.items():
            if template.python == python and template.alive and template.ranks < self.per_template:
                return source, template
        self._count += 1
        source = f"{python}#{self._count}"
        self.templates[source] = TemplateClient(self.io.loop, _Events(self, source), tuple(self.inherited.warm_modules),
                                                python=python)
        return source, self.templates[source]

    def _launch(self, om: OwnedMesh, env: dict, ranks=None) -> None:
        me = self.inherited
        ref = om.ref
        om.env = env
        for r in (range(ref.size) if ranks is None else ranks):
            sink = self.hooks.output.current  # looked up per line: the kernel may install one later
            remote = om.links is not None
            record = list if remote else self.hooks.record.all  # an agent records its ranks' lines itself
            om.readers[r] = [LineReader(ref.name, r, stream, sink, record) for stream in ("stdout", "stderr")]
            cfg = LaunchConfig(
                key=me.key, rundir=me.rundir, owner=ref.owner, rank=r, mesh=ref,
                sys_path=tuple(sys.path), cwd=os.getcwd(), env={**config.exported_env(), **env},
                fanout=self.outbox.fanout,
                # The root controller's template removes the run directory if it is killed.
                cleanup_dirs=tuple([me.rundir] + ([me.segments.dir] if me.segments else [])
                                   if me.owns_rundir() and not remote else []),
                bootstrap=om.bootstrap, curve=self.network.curve,
                job_ports=self.network.job_ports_for(me.job_ports, me.address, ref.owner),
                address=ref.addresses[r] if remote else None,
                python=om.python if om.python != sys.executable and not remote else None,
            )
            source, forker = self._forker(om, r)  # an interpreter that will not start raises here, to the spawner
            om.sources[r] = source
            try:
                forker.fork(cfg, functools.partial(self._forked, om, r), functools.partial(self._fork_failed, om, r))
            except OSError:
                pass  # the template is already gone: its exit fails this rank (_on_exit)

    def _forked(self, om: OwnedMesh, rank: int, pid: int) -> None:
        om.pids[rank] = pid
        self.pid_index[(self.source(om, rank), pid)] = (om, rank)

    def _fork_failed(self, om: OwnedMesh, rank: int, why: str) -> None:
        """The template could not make the rank (a limit was reached): it dies, saying why."""
        if rank in om.alive:
            self._died(om, rank, DeathInfo(om.ref.name, rank, 0, om.ref.hosts[rank], None, None, [why],
                                           om.stopping))

    # ------------------------------------------------------------ what templates and agents tell us

    def on_output(self, source: str, pid: int, fd: int, data: bytes) -> None:
        entry = self.pid_index.get((source, pid))
        if entry is not None and fd in (1, 2):
            om, r = entry
            om.readers[r][fd - 1].feed(data)

    def on_beats(self, source: str, pids) -> None:
        now = time.monotonic()
        for pid in pids:
            entry = self.pid_index.get((source, pid))
            if entry is not None:
                om, r = entry
                om.last_beat[r] = now

    def on_hello(self, frame: bytes) -> None:
        """A rank is up (its ``RankHello``); a failed bootstrap fails the spawn (or restart)
        with its traceback; the rank stays up until it is stopped."""
        try:
            hello = RankHello.decode(frame)
        except MalformedMessage:
            self.drops.count("malformed")
            return
        om = self.meshes.get(hello.mesh)
        rank = hello.rank
        if om is None or rank in om.up or rank not in om.alive:
            return
        failed = hello.failed_status == Status.RAISED
        err = _bootstrap_error(om.ref.name, rank, Part(rank, Status.RAISED, hello.failed_frames)) if failed else None
        if err is not None and not om.ready.done():
            om.ready.set_exception(err)
        om.up.add(rank)
        om.last_beat[rank] = time.monotonic()
        if len(om.up) == om.ref.size and not om.ready.done():
            om.ready.set_result(True)
        back = om.restarting.pop(rank, None)
        if back is not None and err is not None:
            back.set_exception(err)
        elif back is not None:
            back.set_result(True)

    def on_exit(self, pid: int | None, status: int | None, source: str = sys.executable, why: str = "") -> None:
        """A rank forked by ``source`` (a template's id, or a host's link id) exited; pid
        None: ``source`` itself is gone, and every rank it forked with it (``why`` says how)."""
        if pid is None:
            self._source_gone(source, why)
            return
        entry = self.pid_index.pop((source, pid), None)
        if entry is None:
            return
        om, r = entry
        assert status is not None  # the template reports a rank's exit with its wait status
        remove_inboxes(om.ref.addresses[r])
        self.receiver.drain(self.inbox)  # answers it sent just before dying still count
        info = DeathInfo.from_status(om.ref.name, r, pid, om.ref.hosts[r], status, om.readers[r][1].tail)
        info.stopped = om.stopping
        self._died(om, r, info)

    def _source_gone(self, source: str, why: str) -> None:
        link = self.links.get(source)
        for om in list(self.meshes.values()):
            ranks = sorted(r for r in om.alive if self.source(om, r) == source)
            if not ranks:
                continue
            if not om.ready.done():
                om.stopping = True  # it never came up: its spawner hears (ready fails), nobody else
            for r in ranks:
                rank_pid = om.pids[r]
                if rank_pid is not None:
                    self.pid_index.pop((source, rank_pid), None)
                if link is not None:
                    reason = f"(its host {link.host} is gone: {why})"
                elif rank_pid is not None:
                    reason = "(its host process, the template, exited)"
                else:
                    python = source.rsplit("#", 1)[0]
                    reason = (f"(the template running {python} exited before forking it: can {python} "
                              "start and import monarch_kernel?)")
                self._died(om, r, DeathInfo(om.ref.name, r, rank_pid or 0, om.ref.hosts[r], None,
                                            signal.SIGKILL if rank_pid is not None or link else None,
                                            [reason], om.stopping))

    def _died(self, om: OwnedMesh, rank: int, info: DeathInfo) -> None:
        om.alive.discard(rank)
        killed = om.dying.pop(rank, None)
        self.supervision.on_death(om, rank, info, on_purpose=killed is not None)
        if killed is not None:
            killed.set_result(True)
        if not om.alive:
            om.exited.set_result(True)
            if om.stopping:  # nothing will call it again: forget it
                self.meshes.pop(om.ref.id, None)
                self.supervision.forget_hosted(om.ref.id)

    # ------------------------------------------------------------ restarting and killing

    def restart(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """Start dead ``ranks`` again in place: same rank numbers and addresses, fresh
        processes.  Returns one completion per rank, done when it has connected."""
        return self.io.run(self._restart, om, list(ranks))

    def _restart(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """On the IO thread, so that it runs wholly after the handling of the death it
        replaces (its handling, ``_died`` and the policy's ``on_death``, fails the calls first,
        which wakes the caller that asks for this restart, and only then fails what waits in
        ``restarting``)."""
        if om.stopping:
            raise RuntimeError(f"mesh '{om.ref.name}' was stopped; spawn a new one")
        alive = [r for r in ranks if r in om.alive]
        if alive:
            raise ValueError(f"ranks {alive} of mesh '{om.ref.name}' are alive; only dead ranks can be restarted")
        done = []
        for r in ranks:
            om.restarting[r] = c = Completion()
            done.append(c)
        for r in ranks:
            om.alive.add(r)
            om.up.discard(r)
        self.supervision.on_revive(om, ranks)
        self._launch(om, om.env, ranks)
        return done

    def kill(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """SIGKILL ``ranks`` (ones that stopped responding); their pending calls then fail
        with ``ProcessDied``.  One completion per rank, done once its death is handled."""
        done = []
        for r in ranks:
            c = Completion()
            om.dying[r] = c
            done.append(c)
            if r not in om.alive:
                c.set_result(True)
            else:
                kill_rank(om, r)
        return done

    def stop(self, om: OwnedMesh) -> Completion:
        """End every rank of ``om`` (``Kind.STOP``, then SIGKILL after ``STOP_GRACE_S``);
        the completion is done once they have all exited."""
        self.io.call_soon(self._stop, om)
        return om.exited

    def _stop(self, om: OwnedMesh) -> None:
        if om.stopping:
            return
        om.stopping = True
        self.outbox.send_tree(om.ref, sorted(r for r in om.alive if r in om.up), Kind.STOP)
        for r in list(om.alive):
            if r not in om.up:
                kill_rank(om, r)
        self.io.loop.call_later(STOP_GRACE_S, self._kill_rest, om)

    @staticmethod
    def _kill_rest(om: OwnedMesh) -> None:
        for r in list(om.alive):
            kill_rank(om, r)

    # ------------------------------------------------------------ hosts

    def add_host(self, host: str) -> AgentLink:
        """A link for the agent a job is about to start on ``host``; its ``credentials()`` go
        to the agent's stdin, and ``up`` completes when it has connected."""
        link = AgentLink(host=host, events=None, io=self.io, network=self.network, outbox=self.outbox,
                         inherited=self.inherited)
        link.events = _Events(self, link.id)
        self.links[link.id] = link
        if not self._beating:
            self._beating = True
            self.io.call_soon(self._beat)
        return link

    def end_host(self, link: AgentLink, bye: bool = True) -> None:
        """End a host on purpose (``job.kill()``): the ranks there stop, which is no failure.
        ``bye=False``: only mark them so, for an agent that its job ends another way (an
        attached worker, told over its own connection)."""
        def go():
            for om in list(self.meshes.values()):
                if om.links is not None and any(lk is link for lk in om.links):
                    om.stopping = True
            if bye:
                link.close()

        self.io.run(go)

    def forget_host(self, link: AgentLink, why: str) -> None:
        """Drop an agent ended before it connected (its job starts it again another way)."""
        self.io.run(lambda: link.gone(why))
        self.links.pop(link.id, None)  # after: the IO thread heard it, and never hears it again

    def on_host(self, origin: str, host_id: str, msg) -> None:
        """A ``host_messages`` message from the agent of host ``host_id``."""
        link = self.links.get(host_id)
        if link is not None and link.alive:
            link.on_message(origin, msg)

    def _beat(self) -> None:
        now = time.monotonic()
        for link in list(self.links.values()):
            link.beat(now)
        self.io.loop.call_later(agent_channel.BEAT_S, self._beat)

    def close(self) -> None:
        """At exit: every rank we spawned is killed, then the templates and the hosts' agents.
        Their meshes are marked stopping first: ranks ended by their own controller's shutdown
        are no failure.  First the local ranks' last output is shown: what they wrote before
        the exit (a script's final lines from its actors) is read and printed, waiting at most
        ``exit_drain`` seconds for it."""
        for om in list(self.meshes.values()):
            om.stopping = True
        if self.pid_index and not self.io.is_current():
            deadline = time.monotonic() + EXIT_DRAIN_S
            for done in [t.drain() for t in list(self.templates.values()) if t.alive]:
                done.wait(max(0.0, deadline - time.monotonic()))
        for om, r in list(self.pid_index.values()):
            kill_rank(om, r)
        for template in list(self.templates.values()):
            template.close()
        for link in list(self.links.values()):
            link.close()


class _Events:
    """What one template (or one host's agent) tells the launcher, tagged with its source."""

    def __init__(self, launcher: Launcher, source: str):
        self.launcher, self.source = launcher, source

    def exited(self, pid: int | None, status: int | None, why: str = "") -> None:
        self.launcher.on_exit(pid, status, self.source, why)

    def output(self, pid: int, fd: int, data: bytes) -> None:
        self.launcher.on_output(self.source, pid, fd, data)

    def hello(self, pid: int, hello: bytes) -> None:
        self.launcher.on_hello(hello)

    def beats(self, pids) -> None:
        self.launcher.on_beats(self.source, pids)


def _bootstrap_error(mesh: str, rank: int, part: Part) -> ActorError:
    failure = part.load()
    err = ActorError(failure, f"the bootstrap function of mesh '{mesh}' raised on rank {rank} (pid {failure.pid} "
                              f"on {failure.host}): {failure.type_name}: {failure.message}\n\n"
                              f"Traceback from rank {rank}:\n{failure.traceback.rstrip()}")
    err.__cause__ = failure.exception()
    return err
