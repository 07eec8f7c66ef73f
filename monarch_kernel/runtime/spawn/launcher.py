"""The launcher: starts the ranks of the meshes this process spawns, restarts, kills and
stops them, and ends them all at exit.

It owns the templates that fork local ranks and fills the ``OwnedMesh`` record of each mesh
(in ``meshes``, the runtime's table).  What the forkers then say of the ranks (up, beats,
output, exits) is the rank events' (``rank_events.py``); the agents of this process's hosts
are the host links' (``host_links.py``).  A death is learnt from the process exit, never by
polling; what it means is the supervision policy's to decide.

It is given its collaborators, typed by what it uses of them, and what each rank inherits
from this process (``Inherited``), never the runtime itself.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from .. import config
from ..completion import Completion
from ..context import MeshRef, current_actor
from ..limits import raise_nofile_limit
from ..wire.envelope import Header, Kind
from . import output_drain
from .agent_link import AgentLink, StandbyForker
from .launch_config import LaunchConfig
from .owned_mesh import OwnedMesh
from .rank_events import RankEvents, source_of
from .rank_output import LineReader, Sink
from .rank_remains import kill_rank
from .relocation import Home, move, new_homes
from .standby import warm_candidates
from .template_client import TemplateClient

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..hooks import Hooks
    from ..net.io_thread import IOThread
    from ..net.network import Network
    from ..wire.payloads import MovedNotice
    from ..wire.segments import Segments
    from .host_links import HostLinks

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
    owns_rundir: bool  # the root controller's: its template removes the run directory if it is killed


class Sender(Protocol):
    """What the launcher sends with: the runtime's outbox (``calls/outbox.py``, a room above
    this one, which spawn/ never imports)."""

    fanout: int

    def send_tree(self, mesh: MeshRef, ranks, kind: int, body: list | None = None, payload=None) -> None: ...

    def send_or_report(self, address: str, h: Header, body: list, what: str) -> bool: ...

    def forwards(self) -> dict[str, str]: ...

    def claim(self, addresses) -> None: ...


class RevivePolicy(Protocol):
    """What a restart tells: the supervision policy (``calls/supervision.py``)."""

    def on_revive(self, om: OwnedMesh, ranks: list[int]) -> None: ...

    def on_moved(self, notices: list[MovedNotice]) -> None: ...


class Launcher:
    """Held by the runtime as ``rt.launcher``.  Its public methods may be called from any
    thread (they hand their work to the IO thread)."""

    def __init__(self, *, io: IOThread, network: Network, outbox: Sender, meshes: dict[str, OwnedMesh], hooks: Hooks,
                 supervision: RevivePolicy, events: RankEvents, hosts: HostLinks, inherited: Inherited,
                 python: str | None = None):
        """``meshes``: the runtime's table of meshes this process spawned, filled here;
        ``events``: where forkers' reports go; ``hosts``: the links ranks on other hosts are
        forked through; ``python``: the interpreter procs start with unless a spawn names
        one (in a rank, its own spawner's, so that its procs start through it too)."""
        self.io, self.network, self.outbox, self.hooks = io, network, outbox, hooks
        self.supervision, self.events, self.hosts, self.inherited = supervision, events, hosts, inherited
        self.meshes = meshes
        self.links = hosts.links  # the host links' table (read by tests and ``%mesh status``)
        self.templates: dict[str, TemplateClient] = {}  # source id (python#n) -> its template
        # python -> (source id, modules): the template replaced ranks fork from (warm_standby)
        self.standbys: dict[str, tuple[str, frozenset]] = {}
        self.last_standby: dict[str, str] = {}  # python -> the ready standby a new one replaces
        self._count = 0  # templates started
        self.python = python
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
            ports = self.hosts.reserve(hosts, per, check)  # first: a host without room refuses before lists of n
            links = [hosts[r // per] for r in range(n)]
            addresses = tuple(f"tcp://{links[r].ip}:{ports[links[r].id][r % per]}" for r in range(n))
            self.outbox.claim(addresses)  # before the forks: they inherit this process's forwards
            owner = cast(str, self.network.net_address)  # it listens for hosts before their agents start
            ref = MeshRef(mesh_id, name, dims, addresses, owner, tuple(link.host for link in links))
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

    def start_templates(self, n: int, python: str | None = None) -> None:
        """Have templates of ``python`` with room for ``n`` more ranks start now (on the IO
        thread, not waited for): the interpreter's start and imports, the longest part of a
        local spawn, then overlap what the spawn sets up before it forks.  ``spawn`` forks from
        them, or starts what is still missing (the warm modules named by then are imported)."""
        python = python or self.python or sys.executable

        def start() -> None:
            room = sum(self.per_template - t.ranks for t in self.templates.values()
                       if t.python == python and t.alive and t.ranks < self.per_template)
            try:
                while room < n:
                    self._new_template(python)
                    room += self.per_template
            except OSError:  # ``python`` cannot be run: the spawn's own start raises it, saying so
                pass

        self.io.call_soon(start)

    def source(self, om: OwnedMesh, rank: int) -> str:
        """What forked ``rank``: a local template or a host's agent (its id)."""
        return source_of(om, rank)

    def _forker(self, om: OwnedMesh, rank: int,
                restart: bool = False) -> tuple[str, TemplateClient | AgentLink | StandbyForker]:
        """Who forks ``rank``, and its source id: the host's agent, or a local template of the
        mesh's interpreter with room (one holds 3 pipes per rank: past its open-files limit
        the next template takes over, so a limit of 1,024 still fits thousands of ranks).  A
        ``restart`` forks from the warm standby (here, or the agent's), once it has imported
        its modules."""
        if om.links is not None:
            link = om.links[rank]
            return link.id, link.restarts() if restart else link
        python = om.python
        # The standby, else the one it is replacing while it imports more (a cold fork would
        # pay the import of torch again: a rank restarted by hand then joins an elastic job late).
        for source in (self.standbys.get(python, ("", frozenset()))[0], self.last_standby.get(python, "")):
            standby = self.templates.get(source)
            if restart and standby is not None and standby.alive and standby.nofile is not None \
                    and standby.ranks < self.per_template:
                return source, standby
        for source, template in self.templates.items():
            if template.python == python and template.alive and template.ranks < self.per_template:
                return source, template
        return self._new_template(python)

    def _new_template(self, python: str) -> tuple[str, TemplateClient]:
        """(IO thread) A template of ``python`` holding the warm modules named so far."""
        self._count += 1
        source = f"{python}#{self._count}"
        self.templates[source] = TemplateClient(self.io.loop, self.events.of(source),
                                                tuple(self.inherited.warm_modules), python=python)
        return source, self.templates[source]

    def _launch(self, om: OwnedMesh, env: dict, ranks=None, restart: bool = False) -> None:
        me = self.inherited
        ref = om.ref
        om.env = env
        for r in (range(ref.size) if ranks is None else ranks):
            # looked up per line: the kernel may install one later (an OutputSink is a Sink, or has write())
            sink = cast("Callable[[], Sink]", self.hooks.output.current)
            remote = om.links is not None
            record = list if remote else self.hooks.record.all  # an agent records its ranks' lines itself
            om.readers[r] = [LineReader(ref.name, r, stream, sink, record) for stream in ("stdout", "stderr")]
            cfg = LaunchConfig(
                key=me.key, rundir=me.rundir, owner=ref.owner, rank=r, mesh=ref,
                sys_path=tuple(sys.path), cwd=os.getcwd(), env={**config.exported_env(), **env},
                fanout=self.outbox.fanout,
                # The root controller's template removes the run directory if it is killed.
                cleanup_dirs=tuple([me.rundir] + ([me.segments.dir] if me.segments else [])
                                   if me.owns_rundir and not remote else []),
                bootstrap=om.bootstrap, curve=self.network.curve,
                job_ports=self.network.job_ports_for(me.job_ports, me.address, ref.owner),
                address=ref.addresses[r] if remote else None,
                python=om.python if om.python != sys.executable and not remote else None,
                forwards=self.outbox.forwards(),
            )
            source, forker = self._forker(om, r, restart)  # an interpreter that will not start raises here
            om.sources[r] = source
            try:
                forker.fork(cfg, functools.partial(self.events.forked, om, r, source),
                            functools.partial(self.events.fork_failed, om, r))
            except OSError:
                pass  # the template is already gone: its exit fails this rank (_on_exit)

    # ------------------------------------------------------------ restarting and killing

    def restart(self, om: OwnedMesh, ranks: list[int]) -> list[Completion]:
        """Start dead ``ranks`` again: same rank numbers, fresh processes, at the same
        addresses, except ranks whose host is gone: those start on another live host of the
        mesh that has room (``relocation.py``), and every process that may send to them is told
        their new address.  Returns one completion per rank, done when it has connected."""
        # Here: it waits for hosts' answers, which the IO thread reads (so never there).
        homes = {} if self.io.is_current() else new_homes(self.hosts, om, list(ranks), config.check_limits())
        return self.io.run(self._restart, om, list(ranks), homes)

    def _restart(self, om: OwnedMesh, ranks: list[int], homes: dict[int, Home] | None = None) -> list[Completion]:
        """On the IO thread, so that it runs wholly after the handling of the death it
        replaces (its handling, ``_died`` and the policy's ``on_death``, fails the calls first,
        which wakes the caller that asks for this restart, and only then fails what waits in
        ``restarting``).  ``homes``: rank -> (the live host's link, a port reserved there) for
        ranks whose host is gone."""
        if om.stopping:
            raise RuntimeError(f"mesh '{om.ref.name}' was stopped; spawn a new one")
        alive = [r for r in ranks if r in om.alive]
        if alive:
            raise ValueError(f"ranks {alive} of mesh '{om.ref.name}' are alive; only dead ranks can be restarted")
        homes = homes or {}
        gone = [r for r in ranks if om.links is not None and not om.links[r].alive and r not in homes]
        if gone:  # its address is on that host, and no other host was found for it
            link = om.links[gone[0]]  # type: ignore[index]
            raise ConnectionError(f"ranks {gone} of mesh '{om.ref.name}' cannot be restarted: their host {link.host} "
                                  f"is gone ({link.why_gone or 'its agent ended'})")
        lost = sorted({link.host for link, _port in homes.values() if not link.alive})
        if lost:
            raise ConnectionError(f"ranks {sorted(homes)} of mesh '{om.ref.name}' cannot be restarted: their host "
                                  f"is gone, and so is the host they were to move to ({', '.join(lost)})")
        done = []
        for r in ranks:
            om.restarting[r] = c = Completion()
            done.append(c)
        for r in ranks:
            om.alive.add(r)
            om.up.discard(r)
        if homes:
            self.supervision.on_moved(move(om, homes))
        self.supervision.on_revive(om, ranks)
        self._launch(om, om.env, ranks, restart=True)
        return done

    def warm_standby(self, om: OwnedMesh) -> list[str]:
        """Have a standby template hold the heavy modules ``om``'s live ranks imported
        (``standby.py``), started anew when they imported more; replaced ranks fork from it.
        Ranks on other hosts: each host's agent keeps its own, read from its ranks.  Returns
        the modules it holds (every host's), [] while it is still importing them."""
        return self.io.run(self._warm_standby, om)

    def _warm_standby(self, om: OwnedMesh) -> list[str]:
        if om.stopping:
            return []
        if om.links is not None:
            return self._warm_hosts(om)
        source, held = self.standbys.get(om.python, ("", frozenset()))
        pid = next((om.pids[r] for r in sorted(om.alive & om.up) if om.pids[r]), None)
        current = self.templates.get(source)
        ready = sorted(held) if current is not None and current.alive and current.nofile is not None else []
        if pid is None:
            return ready
        new = set(warm_candidates(pid, set(self.inherited.warm_modules) | held))
        if not new:  # a standby that died importing them is not started again for the same ones
            return ready
        modules = held | new
        if current is not None and current.alive and current.nofile is not None:
            self.last_standby[om.python] = source  # forks restarts until the new one has imported
        self._count += 1
        source = f"{om.python}#{self._count}"
        self.templates[source] = TemplateClient(self.io.loop, self.events.of(source),
                                                (*self.inherited.warm_modules, *sorted(modules)), python=om.python)
        self.standbys[om.python] = (source, frozenset(modules))
        return []

    def _warm_hosts(self, om: OwnedMesh) -> list[str]:
        """Ask each live host of ``om`` to warm its standby from its live ranks of ``om``; the
        modules every one of them said it holds (they answer later: asked again, they say more)."""
        links: dict[str, tuple[AgentLink, list[int]]] = {}
        for r, link in enumerate(cast("list[AgentLink]", om.links)):
            if link.alive:
                pids = links.setdefault(link.id, (link, []))[1]
                if r in om.alive and r in om.up and (pid := om.pids[r]):
                    pids.append(pid)
        held = [set(link.warm(pids) if pids else link.standby or ()) for link, pids in links.values()]
        return sorted(set.intersection(*held)) if held else []

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

    def drain_output(self, timeout: float) -> bool:
        """(Not the IO thread) Wait until every byte this process's ranks had written when it was
        called has reached the output hooks (``output_drain``).  False if some template or
        agent did not answer within ``timeout`` s; nothing is asked when no rank is alive."""
        if not self.events.pid_index or self.io.is_current():
            return True
        return output_drain.drain(self.io, lambda: [
            *(t for t in self.templates.values() if t.alive and t.ranks > 0),
            *(link for link in self.links.values() if link.alive and link.address is not None)], timeout)

    def close(self) -> None:
        """At exit: every rank we spawned is killed, then the templates and the hosts' agents.
        Their meshes are marked stopping first: ranks ended by their own controller's shutdown
        are no failure.  First the local ranks' last output is shown: what they wrote before
        the exit (a script's final lines from its actors) is read and printed, waiting at most
        ``exit_drain`` seconds for it."""
        for om in list(self.meshes.values()):
            om.stopping = True
        if self.events.pid_index and not self.io.is_current():
            deadline = time.monotonic() + EXIT_DRAIN_S
            for done in [t.drain() for t in list(self.templates.values()) if t.alive]:
                done.wait(max(0.0, deadline - time.monotonic()))
        for om, r in list(self.events.pid_index.values()):
            kill_rank(om, r)
        for template in list(self.templates.values()):
            template.close()
        self.hosts.close()
