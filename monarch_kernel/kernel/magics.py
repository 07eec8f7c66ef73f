"""``%mesh`` and ``%%mesh``: drive meshes from notebook cells.

One ``Magics`` class; every mistake is a ``UsageError`` that says what to type instead.
"""

from __future__ import annotations

import shlex
import time
import uuid

from IPython.core.display_functions import display, publish_display_data
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope

from ..actor.errors import ActorError
from ..mesh import host_mesh
from ..mesh.host_mesh import this_host
from ..runtime.process import Runtime
from . import debugger, detached, status
from .console import Console
from .mesh_pdb import PdbHub, ServeWhileWaiting
from .output import CollapsingSink, rank_label

INTERRUPT_GRACE_S = 10.0  # how long an interrupted cell waits for the ranks to stop

USAGE = """\
%mesh spawn -n N [--name M] [--env K=V] [--detach M]
                                 start N ranks (returns the ProcMesh; it becomes current);
                                 --detach keeps them running after the kernel ends
%mesh attach M                   reconnect to a detached mesh (after a kernel restart)
%mesh list | use M | stop [M]    list meshes, switch, or end one
%mesh status                     each rank's pid and state
%mesh restart [--ranks R]        replace dead ranks (same numbers, fresh namespaces)
%mesh push name=expr ...         set names on every rank
%mesh pull name                  a ValueMesh of name from every rank
%mesh scatter name=expr          split a list/array/tensor across the ranks
%mesh gather name                join name's pieces from every rank
%mesh auto on|off                run every following cell on the mesh
%mesh debug R [--listen]         JupyterLab's debugger on rank R (--listen: a VS Code attach
                                 config instead);  %mesh debug off  debugs the kernel again
%mesh pdb [attach R | cast RANKS CMD | continue | --post-mortem on|off]
                                 ranks stopped in breakpoint(), and talking to them
%%mesh [--ranks SPEC] [--timeout S] [--no-stream] [--group-outputs rank|order]
                                 run the cell on the ranks (SPEC: 0 | 0-3 | 0,2 | ::2)"""


def parse_ranks(spec: str, n: int) -> list[int]:
    """``0``, ``0-3``, ``0,2``, ``::2`` -> rank list within ``range(n)``."""
    out: list[int] = []
    for piece in spec.split(","):
        piece = piece.strip()
        try:
            if ":" in piece:
                parts = [int(p) if p else None for p in piece.split(":")]
                out.extend(range(n)[slice(*parts)])
            elif "-" in piece:
                a, b = (int(p) for p in piece.split("-", 1))
                out.extend(range(a, b + 1))
            else:
                out.append(int(piece))
        except ValueError:
            raise UsageError(f"--ranks {spec!r}: write ranks like 0, 0-3, 0,2 or ::2") from None
    bad = [r for r in out if not 0 <= r < n]
    if bad or not out:
        raise UsageError(f"--ranks {spec!r}: the mesh has ranks 0-{n - 1}")
    return sorted(set(out))


class MeshSession:
    """The meshes this kernel spawned and which one is current."""

    def __init__(self, shell):
        self.shell = shell
        self.meshes: dict[str, tuple] = {}  # name -> (ProcMesh, console ActorMesh)
        self.current: str | None = None
        self.auto = False
        self.live = None  # the %mesh status widget that is refreshing, if any
        self.hosts: dict = {}  # name -> MeshHost ActorMesh, for detached meshes
        rt = Runtime.current()
        self.sink = CollapsingSink(rt.io.loop)
        rt.output_sink = self.sink
        shell.events.register("pre_run_cell", self.sink.follow_cell)
        shell.events.register("pre_run_cell", self._remember_cell)
        self.raw_cell = ""  # the running cell as typed: %%mesh compiles under its name
        self.pdb = PdbHub(self)
        self.spawning = False  # %mesh spawn is starting a mesh (it sets pdb up through the console)
        Runtime.wait_hook = ServeWhileWaiting(self.pdb)
        host_mesh.spawned_hooks.append(self.pdb.mesh_spawned)

    def _remember_cell(self, info=None) -> None:
        self.raw_cell = getattr(info, "raw_cell", "") or ""

    def cell_file(self, line: str, body: str) -> tuple[str, str, int]:
        """(the whole cell, the file name it compiles under, lines before ``body``).

        The name is the one JupyterLab's ``dumpCell`` gives the cell, so breakpoints set in
        the notebook land on the rank; line numbers count the ``%%mesh`` line.
        """
        raw, stripped = self.raw_cell, body.rstrip()
        start = raw.rfind(stripped) if stripped else -1
        if start < 0 or raw[start:].rstrip() != stripped:
            raw, start = f"%%mesh {line}".rstrip() + "\n" + body, len(f"%%mesh {line}".rstrip()) + 1
        try:
            from ipykernel.compiler import get_file_name
        except ImportError:  # IPython without ipykernel: no debugger to agree with
            return raw, f"<mesh-cell-{abs(hash(raw)):x}>", raw.count("\n", 0, start)
        return raw, get_file_name(raw), raw.count("\n", 0, start)

    def get(self, name: str | None = None):
        name = name or self.current
        if name is None:
            raise UsageError("no mesh yet: start one with  procs = %mesh spawn -n 4")
        if name not in self.meshes:
            raise UsageError(f"no mesh named {name!r}; %mesh list shows: {', '.join(self.meshes) or 'none'}")
        return self.meshes[name]


@magics_class
class MeshMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.session = MeshSession(shell)

    # ------------------------------------------------------------ %mesh

    @needs_local_scope
    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None, local_ns=None):
        if cell is not None:
            return self._run_cell(line, cell)
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%mesh: {e}") from None
        if not words:
            raise UsageError(USAGE)
        cmd, args = words[0], words[1:]
        handler = getattr(self, f"_cmd_{cmd}", None)
        if handler is None:
            raise UsageError(f"%mesh {cmd}: unknown command.\n{USAGE}")
        return handler(args, local_ns or {})

    def _cmd_spawn(self, args, _ns):
        n, name, env, detach = 1, None, {}, None
        it = iter(args)
        for a in it:
            if a in ("-n", "--n"):
                n = self._int(next(it, None), "-n", "%mesh spawn -n 4")
            elif a == "--name":
                name = next(it, None)
                if not name:
                    raise UsageError("--name needs a value: %mesh spawn -n 4 --name trainers")
            elif a == "--detach":
                detach = next(it, None)
                if not detach or not detach.replace("-", "_").isidentifier():
                    raise UsageError("--detach needs a name: %mesh spawn -n 4 --detach trainers")
            elif a == "--env":
                k, eq, v = (next(it, None) or "").partition("=")
                if not eq or not k:
                    raise UsageError("--env takes NAME=VALUE: %mesh spawn -n 4 --env OMP_NUM_THREADS=1")
                env[k] = v
            else:
                raise UsageError(f"%mesh spawn: unexpected {a!r}; type  %mesh spawn -n 4 [--name M] [--env K=V ...]")
        if n < 1:
            raise UsageError("-n must be at least 1: %mesh spawn -n 4")
        s = self.session
        if detach:
            name = detach
        if name in s.meshes:
            raise UsageError(f"a mesh named {name!r} exists; %mesh stop {name} first, or pick another --name")
        env.setdefault("MPLBACKEND", "Agg")  # figures are collected and shown in the cell
        if detach:
            procs = detached.spawn(s, detach, n, env)
        else:
            s.spawning = True
            try:
                procs = this_host().spawn_procs(per_host={"ranks": n}, name=name, env=env)
            finally:
                s.spawning = False
            s.meshes[procs.name] = (procs, procs.spawn("console", Console))
            s.current = procs.name
        s.pdb.tell_ranks(procs.name)
        return procs

    @staticmethod
    def _int(value, flag: str, example: str) -> int:
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UsageError(f"{flag} takes a number: {example}") from None

    def _cmd_attach(self, args, _ns):
        if len(args) != 1:
            raise UsageError("type  %mesh attach NAME  (the name given to --detach)")
        if args[0] in self.session.meshes:
            raise UsageError(f"mesh {args[0]!r} is already attached; %mesh use {args[0]} makes it current")
        procs = detached.attach(self.session, args[0])
        # Ranks report pdb stops to this kernel now; sessions left by the old one run on.
        self.session.pdb.tell_ranks(procs.name)
        return procs

    def _cmd_list(self, _args, _ns):
        s = self.session
        others = [r for r in detached.records() if r["name"] not in s.meshes]
        if not s.meshes and not others:
            print("no meshes; start one with  procs = %mesh spawn -n 4")
        for name, (procs, _c) in s.meshes.items():
            mark = "*" if name == s.current else " "
            kind = ", detached" if name in s.hosts else ""
            print(f"{mark} {name}: {len(procs)} ranks, {'stopped' if procs._stopped else 'running'}{kind}")
        for rec in others:
            if rec["alive"]:
                print(f"  {rec['name']}: detached, running (host pid {rec['pid']}); %mesh attach {rec['name']}")
            else:
                detached.forget(rec["name"])
                print(f"  {rec['name']}: detached, gone (host pid {rec['pid']} exited); its record was removed")

    def _cmd_use(self, args, _ns):
        if len(args) != 1:
            raise UsageError("type  %mesh use NAME  (see %mesh list)")
        self.session.get(args[0])
        self.session.current = args[0]

    def _cmd_stop(self, args, _ns):
        s = self.session
        name = args[0] if args else None
        procs, _c = s.get(name)
        debugger.forget_mesh(self.shell, procs.name)
        host = s.hosts.pop(procs.name, None)
        if host is not None:
            info = detached.read_record(procs.name)
            if info is not None and detached.host_alive(info):
                host.stop.call_one().get(timeout=60)
            else:
                print(f"detached mesh {procs.name!r} was already gone: its host process is no longer running")
            detached.forget(procs.name)
        else:
            procs.stop().get(timeout=30)
        del s.meshes[procs.name]
        if s.current == procs.name:
            s.current = next(iter(s.meshes), None)

    def _cmd_status(self, _args, _ns):
        procs, consoles = self.session.get()
        host = self.session.hosts.get(procs.name)
        if host is not None:
            print(detached.status_text(procs.name, host.status.call_one().get(timeout=30), self.session.sink.last_lines))
            return None
        print(status.as_text(procs.name, status.snapshot(procs, consoles, self.session.sink.last_lines)))
        try:
            live = status.LiveStatus(self.session)
        except ImportError:  # no ipywidgets: the text table is all there is
            return None
        if self.session.live is not None:
            self.session.live.close()
        self.session.live = live
        display(live.widget)

    def _cmd_restart(self, args, _ns):
        procs, consoles = self.session.get()
        rt = Runtime.current()
        dead = [r for r in range(len(procs)) if (procs._ref.id, r) in rt.dead]
        om = procs._owned
        if om is not None:  # ranks that stopped answering heartbeats are replaced too
            stuck = [r for r in range(len(procs)) if r not in dead and not om.responding(r)]
            if stuck:
                print(f"{rank_label(stuck)} not responding: killing, to replace")
                for c in rt.launcher.kill(om, stuck):
                    if not c.wait(10):
                        raise TimeoutError(f"timed out after 10 s waiting for {rank_label(stuck)} to die")
                dead = sorted(dead + stuck)
        if args[:1] == ["--ranks"]:
            if len(args) != 2:
                raise UsageError("type  %mesh restart [--ranks 0-3]")
            ranks = parse_ranks(args[1], len(procs))
            alive = [r for r in ranks if r not in dead]
            if alive:
                raise UsageError(f"ranks {alive} are alive; %mesh restart only replaces dead ranks ({dead or 'none are dead'})")
        elif args:
            raise UsageError("type  %mesh restart [--ranks 0-3]")
        else:
            ranks = dead
        if not ranks:
            print("no dead ranks to restart")
            return
        host = self.session.hosts.get(procs.name)
        if host is not None:
            host.restart.call_one(ranks).get(timeout=120)
        else:
            procs._restart(ranks, [(consoles, Console, (), {})])
        print(f"restarted {rank_label(ranks)} with fresh namespaces")

    def _cmd_auto(self, args, _ns):
        if args not in (["on"], ["off"]):
            raise UsageError("type  %mesh auto on  or  %mesh auto off")
        self.session.get()
        self.session.auto = args[0] == "on"
        transformers = self.shell.input_transformers_cleanup  # before %% magics are parsed
        if self.session.auto and _auto_transform not in transformers:
            transformers.append(_auto_transform)
        elif not self.session.auto and _auto_transform in transformers:
            transformers.remove(_auto_transform)

    def _cmd_debug(self, args, _ns):
        debugger.command(self.session, self.shell, args)

    def _cmd_pdb(self, args, _ns):
        self.session.pdb.magic(args)

    def _cmd_push(self, args, ns):
        if not args:
            raise UsageError("type  %mesh push name=expr [name=expr ...]")
        values = {}
        for a in args:
            name, eq, expr = a.partition("=")
            if not eq or not name.isidentifier():
                raise UsageError(f"%mesh push {a!r}: write name=expr, e.g. %mesh push lr=0.1")
            values[name] = self.shell.ev(expr) if expr else None
        _procs, consoles = self.session.get()
        consoles.push.call(values).get(timeout=60)

    def _cmd_pull(self, args, _ns):
        if len(args) != 1 or not args[0].isidentifier():
            raise UsageError("type  %mesh pull name")
        _procs, consoles = self.session.get()
        return consoles.pull.call(args[0]).get(timeout=60)

    def _cmd_scatter(self, args, _ns):
        if len(args) != 1 or "=" not in args[0]:
            raise UsageError("type  %mesh scatter name=expr  (a list, array or tensor, split along its first dim)")
        name, _, expr = args[0].partition("=")
        if not name.isidentifier():
            raise UsageError(f"%mesh scatter {args[0]!r}: write name=expr")
        _procs, consoles = self.session.get()
        chunks = split_along_ranks(self.shell.ev(expr), len(consoles))
        futs = [consoles.slice(ranks=r).push.call_one({name: c}) for r, c in enumerate(chunks)]
        for f in futs:
            f.get(timeout=60)

    def _cmd_gather(self, args, _ns):
        if len(args) != 1 or not args[0].isidentifier():
            raise UsageError("type  %mesh gather name")
        _procs, consoles = self.session.get()
        return join_along_ranks(list(consoles.pull.call(args[0]).get(timeout=60).values()))

    # ------------------------------------------------------------ %%mesh

    def _run_cell(self, line: str, cell: str):
        ranks_spec, timeout, stream, group = None, None, True, "order"
        words = shlex.split(line)
        it = iter(words)
        for a in it:
            if a == "--ranks":
                ranks_spec = next(it, None)
                if ranks_spec is None:
                    raise UsageError("--ranks needs a value, e.g. %%mesh --ranks 0-3")
            elif a == "--timeout":
                timeout = float(self._int(next(it, None), "--timeout", "%%mesh --timeout 30"))
            elif a == "--no-stream":
                stream = False
            elif a == "--group-outputs":
                group = next(it, None)
                if group not in ("rank", "order"):
                    raise UsageError("--group-outputs takes rank or order: %%mesh --no-stream --group-outputs rank")
            else:
                raise UsageError(f"%%mesh: unexpected {a!r}; type  %%mesh [--ranks 0-3] [--timeout S] "
                                 "[--no-stream] [--group-outputs rank|order]")
        if group == "rank" and stream:
            raise UsageError("--group-outputs rank needs the whole output first: add --no-stream")
        return run_on_mesh(self.session, cell, ranks_spec, timeout, stream=stream, by_rank=group == "rank", line=line)


def run_on_mesh(session: MeshSession, cell: str, ranks_spec: str | None, timeout: float | None,
                stream: bool = True, by_rank: bool = False, line: str = ""):
    procs, consoles = session.get()
    n = len(procs)
    ranks = parse_ranks(ranks_spec, n) if ranks_spec else list(range(n))
    target = consoles if len(ranks) == n else _select(consoles, ranks)
    token = uuid.uuid4().hex
    whole, filename, offset = session.cell_file(line, cell)
    session.sink.hold = not stream
    opts = {"cell": whole, "line_offset": offset, **session.pdb.cell_options()}
    fut = target.run.call(cell, filename, token, opts)
    interrupted = False
    session.pdb.cell_running = True
    try:
        try:
            results = _wait_with_progress(fut, session.sink, token, len(ranks), timeout, session.pdb)
            session.pdb.announce()
        except KeyboardInterrupt:
            # The stop button: interrupt the ranks' code, keep their namespaces.
            interrupted = True
            # A rank held at a breakpoint is interrupted through its inspector (debugpy holds
            # its IO loop too), then resumed so the interrupt lands on the line it stopped at.
            held = debugger.stopped_rank(session.shell, procs.name, ranks)
            others = [r for r in ranks if r != held]
            Runtime.current().interrupt(procs._ref, others, consoles._actor_id, wait=2.0)
            debugger.release_for_interrupt(session.shell, procs.name, ranks, consoles._actor_id)
            results = fut.get(timeout=INTERRUPT_GRACE_S)
        failed = None
    except ActorError as e:
        results, failed = getattr(e, "results", None), e
    finally:
        session.pdb.cell_running = False
    mesh_name = procs.name
    expected = {(mesh_name, r, s) for r in ranks for s in ("stdout", "stderr")
                if (procs._ref.id, r) not in Runtime.current().dead}
    session.sink.wait_synced(token, expected, 5.0, by_rank)
    session.sink.hold = False
    errors = {}
    if results is not None:
        shown: dict[str, list[int]] = {}  # the same value from several ranks prints once
        displays = []
        for (_point, value), r in zip(results.items(), ranks):
            if isinstance(value, BaseException):
                errors[r] = value
                continue
            if value["value"] is not None:
                shown.setdefault(value["value"], []).append(r)
            displays.extend((r, data, md) for data, md in value["displays"])
        session.shell.user_ns["_mesh"] = results.__class__(
            results.shape, [v if isinstance(v, BaseException) else v["value"] for v in results.values()])
        for r, data, md in displays:
            print(f"[rank {r}]", flush=True)
            publish_display_data(data, {**md, "monarch_kernel": {"rank": r}})
        for value, rs in shown.items():
            print(f"{rank_label(rs)} {value}")
    if interrupted:
        raise KeyboardInterrupt(f"interrupted on ranks {', '.join(map(str, ranks))}; their namespaces are kept")
    if failed is not None:
        raise MeshCellError(errors or {ranks[0]: failed}) from None
    return None


PROGRESS_AFTER_S = 2.0


def _wait_with_progress(fut, sink, token: str, n: int, timeout: float | None, pdb=None):
    """``fut.get(timeout)``, showing "k of n ranks finished" once the cell runs past 2 s,
    and serving ranks that stop in pdb meanwhile."""
    start = time.monotonic()
    handle, shown = None, -1
    while True:
        if pdb is not None and pdb.waiting():
            sink.flush()
            pdb.serve(done=fut.done, auto_attach=n == 1)
        elapsed = time.monotonic() - start
        step = 0.25 if timeout is None else max(0.0, min(0.25, timeout - elapsed))
        try:
            result = fut.get(timeout=step)
            done = True
        except TimeoutError:
            if timeout is not None and time.monotonic() - start >= timeout:
                raise TimeoutError(f"the cell did not finish on every rank within {timeout:g} s "
                                   "(it is still running there; interrupt the kernel to stop it)") from None
            done = False
        except ActorError:
            if handle is not None:
                handle.update(_progress(n, n, time.monotonic() - start), raw=True)
            raise
        elapsed = time.monotonic() - start
        finished = n if done else sink.finished(token)
        if handle is None and not done and elapsed >= PROGRESS_AFTER_S:
            handle = display(_progress(finished, n, elapsed), display_id=True, raw=True)
            shown = finished
        elif handle is not None and (finished != shown or done):
            handle.update(_progress(finished, n, elapsed), raw=True)
            shown = finished
        if done:
            return result


def _progress(finished: int, n: int, elapsed: float) -> dict:
    label = f"{finished} of {n} ranks finished ({elapsed:.1f} s)"
    return {"text/plain": f"[mesh] {label}",
            "text/html": f"<progress value='{finished}' max='{n}'></progress> {label}"}


class MeshCellError(Exception):
    """A ``%%mesh`` cell failed on some ranks; shows each rank's traceback, cell lines only."""

    def __init__(self, errors: dict):
        self.errors = errors
        first = next(iter(errors.values()))
        super().__init__(f"the cell failed on {len(errors)} rank(s): {', '.join(map(str, errors))}")
        self.__cause__ = first

    def _render_traceback_(self) -> list[str]:
        lines = []
        for r, err in self.errors.items():
            text = getattr(err, "remote_traceback", "") or f"{type(err).__name__}: {err}"
            if not getattr(err, "remote_traceback", ""):
                text = str(err)
            lines.append(f"[rank {r}] {clean_traceback(text)}")
        return lines


def clean_traceback(text: str) -> str:
    """Drop the console actor's own frames from a rank's traceback."""
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("  File "):
            skip = "monarch_kernel" in line and "console.py" in line
        elif not line.startswith("    "):
            skip = False
        if not skip:
            out.append(line)
    return "\n".join(out)


def split_along_ranks(value, n: int) -> list:
    """Contiguous, nearly equal chunks of ``value`` along its first dim, one per rank."""
    mod = type(value).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return list(torch.tensor_split(value, n))
    if mod == "numpy":
        import numpy

        return list(numpy.array_split(value, n))
    if isinstance(value, (list, tuple, range)):
        k, extra = divmod(len(value), n)
        out, start = [], 0
        for i in range(n):
            end = start + k + (1 if i < extra else 0)
            out.append(value[start:end])
            start = end
        return out
    raise UsageError(f"%mesh scatter needs a list, tuple, numpy array or torch tensor, not {type(value).__name__}; "
                     f"use %mesh push to send the same value to every rank")


def join_along_ranks(parts: list):
    """The inverse of ``split_along_ranks``."""
    mod = type(parts[0]).__module__.split(".")[0] if parts else ""
    if mod == "torch":
        import torch

        return torch.cat(parts)
    if mod == "numpy":
        import numpy

        return numpy.concatenate(parts)
    if all(isinstance(p, (list, tuple, range)) for p in parts):
        out = []
        for p in parts:
            out.extend(p)
        return out
    return parts


def _select(consoles, ranks):
    """The console actors of the given ranks, as one mesh (contiguous or stepped)."""
    if len(ranks) == 1:
        return consoles.slice(ranks=ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and ranks == list(range(ranks[0], ranks[-1] + 1, step)):
        return consoles.slice(ranks=slice(ranks[0], ranks[-1] + 1, step))
    raise UsageError(f"--ranks selects {ranks}: use a range (0-3), a stride (::2) or a single rank")


def _auto_transform(lines: list[str]) -> list[str]:
    """With ``%mesh auto on``, send each cell to the mesh (``%mesh`` lines stay local)."""
    text = "".join(lines)
    if not text.strip() or text.lstrip().startswith(("%mesh", "%%mesh")):
        return lines
    return ["%%mesh\n", *lines]
