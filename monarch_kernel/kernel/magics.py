"""``%mesh`` and ``%%mesh``: drive meshes from notebook cells.

One ``Magics`` class; every subcommand's arguments and help are declared once, in
``magic_args.py`` (``%mesh``, ``%mesh help [SUB]``, ``%mesh SUB --help`` and ``%mesh?`` all
print from there), and every mistake is a ``UsageError`` that says what to type instead.
Runs in the kernel.
"""

from __future__ import annotations

import os
import shlex
import time

from IPython.core.display_functions import display
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope

from ..actor.host_mesh import this_host
from ..console.console import Console
from ..debug.controller import proxy
from ..history import record_event
from ..observe.metrics import top_table
from ..runtime import config, counted, rank_label
from . import detached, status
from .history_magic import history_command, record_stacks
from .magic_args import CELL, COMMANDS, USAGE, cell_args, full_help, nearest, parse
from .mesh_cell import check_cell, ranks_arg, run_on_mesh
from .respawn import spawn_key, spawn_name
from .restart_notices import policy_text
from .session import MeshSession
from .transfer import join_along_ranks, split_along_ranks


def spawn_wait(n: int) -> float:
    """Seconds to wait for ``n`` ranks' consoles: the spawn timeout, and 0.1 s a rank."""
    return max(config.spawn_timeout(), 0.1 * n)


@magics_class
class MeshMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.session = MeshSession(shell)
        self.line = ""  # the %mesh line running (a spawn's name may be the variable the cell assigns it to)

    @needs_local_scope
    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None, local_ns=None):
        if cell is not None:
            if _asks_help(line.split()):
                print(full_help(CELL))
                return None
            args = parse(cell_args, line)
            if args.group_outputs == "rank" and not args.no_stream:
                raise UsageError("--group-outputs rank needs the whole output first: add --no-stream")
            if args.profile:
                return self._profiled(cell, args, line)
            return run_on_mesh(self.session, cell, args.ranks, args.timeout, stream=not args.no_stream,
                               by_rank=args.group_outputs == "rank", line=line)
        self.line = line
        cmd, _, rest = line.strip().partition(" ")
        if cmd in ("", "--help", "-h"):  # %mesh alone: the list, not an error
            print(USAGE)
            return None
        parser = COMMANDS.get(cmd)
        if parser is None:
            raise UsageError(_unknown(cmd, rest))
        try:
            words = shlex.split(rest)
        except ValueError as e:
            raise UsageError(f"%mesh {cmd}: {e}") from None
        if cmd in ("debug", "pdb", "run"):  # their own grammar (the script's arguments are its own)
            if _asks_help(words[:1]):
                print(full_help(cmd))
                return None
            return getattr(self, f"_cmd_{cmd}")(words)
        if _asks_help(words):
            print(full_help(cmd))
            return None
        return getattr(self, f"_cmd_{cmd.replace('-', '_')}")(parse(parser, rest))

    mesh.__doc__ = USAGE  # %mesh? and %%mesh? show the list (help(), pinfo)

    def _profiled(self, cell: str, args, line: str):
        """``%%mesh --profile``: the cell under torch.profiler on every rank, then the report."""
        from ..spmd.controller.profile import profile

        procs, _consoles = self.session.get()
        check_cell(self.session, cell, line)  # before the profiler starts on the ranks
        prof = profile(procs)
        with prof:
            value = run_on_mesh(self.session, cell, args.ranks, args.timeout, stream=not args.no_stream,
                                by_rank=args.group_outputs == "rank", line=line)
        display(prof.report)
        return value

    # ------------------------------------------------------------ subcommands

    def _cmd_help(self, a):
        name = a.subcommand
        if name is None:
            print(USAGE)
        elif name in COMMANDS or name == CELL:
            print(full_help(name))
        else:
            guess = nearest(name)
            raise UsageError(f"%mesh help {name}: no such subcommand; "
                             + (f"did you mean  %mesh help {guess}" if guess else "%mesh help lists them all"))

    def _cmd_spawn(self, a):
        s = self.session
        name, key = spawn_name(a, s.raw_cell, self.line), spawn_key(a)
        again = s.respawn.reuse(s.meshes, set(s.hosts), name, key)  # a name taken: reuse it, or stop it first
        if again is not None:
            s.current = name
            return again
        env = dict(a.env)
        env.setdefault("MPLBACKEND", "Agg")  # figures are collected and shown in the cell
        if a.job is None and (a.hosts or a.nodes or a.partition or a.account or a.ssh_args or a.python or a.sync_env
                              or a.out_of_cluster or a.login):
            raise UsageError("--hosts, --nodes, --partition, --account, --login, --ssh-args, --out-of-cluster, "
                             "--python and "
                             "--sync-env go with --job; type  "
                             "%mesh spawn --job ssh --hosts h1,h2 -n 2  or  %mesh spawn --job slurm --nodes 2 -n 4")
        s.jobs.check_attach(a)
        if a.detach and a.restart == "on-failure":
            raise UsageError("--restart on-failure does not go with --detach: a detached mesh's host process owns "
                             "its ranks; type  %mesh spawn -n 4 --restart on-failure  for a mesh of this kernel")
        if a.detach:
            job_spec = s.jobs.make(a).spec() if a.job else None  # the mesh's host process starts it
            procs = detached.spawn(s, a.detach, a.n, env, job_spec)
            print(f"mesh {procs.name}: {n_ranks(len(procs))}, detached: they outlive this kernel "
                  f"(%mesh attach {procs.name} reconnects after a restart)")
        elif a.job or a.attach:
            job_name, job = s.jobs.open(a)
            hosts = s.jobs.host_mesh(job)
            procs = hosts.spawn_procs(per_host={"ranks": a.n}, name=name, env=env)
            consoles = procs.spawn("console", Console)
            consoles.initialized().get(timeout=spawn_wait(len(procs)))
            s.add(procs, consoles)
            s.jobs.meshes[procs.name] = job_name
            print(f"mesh {procs.name}: {n_ranks(len(procs))} on job {job_name} "
                  f"({', '.join(hosts.host_names)}; {a.n} per host)")
        else:
            s.spawning = True
            try:
                procs = this_host().spawn_procs(per_host={"ranks": a.n}, name=name, env=env)
            finally:
                s.spawning = False
            consoles = procs.spawn("console", Console)
            consoles.initialized().get(timeout=spawn_wait(len(procs)))  # the notebook needs its consoles up
            s.add(procs, consoles)
            print(f"mesh {procs.name}: {n_ranks(len(procs))} on this host")
        if a.restart == "on-failure":
            procs.set_restart_policy("on-failure", max_restarts=a.max_restarts, restart_window=a.restart_window)
            print(f"restart policy: on-failure, at most {a.max_restarts} restarts within {a.restart_window:g} s"
                  if a.max_restarts >= 0 else "restart policy: on-failure, no limit")
        s.respawn.spawned(procs.name, key)
        s.pdb.tell_ranks(procs.name)
        return procs

    def _cmd_attach(self, a):
        if a.name in self.session.meshes:
            raise UsageError(f"mesh {a.name!r} is already attached; %mesh use {a.name} makes it current")
        attached = detached.attach(self.session, a.name)
        # Ranks report pdb stops to this kernel now; sessions left by the old one run on.
        self.session.pdb.tell_ranks(attached.procs.name)
        print(attached.line())
        return attached.procs

    def _cmd_list(self, _a):
        s = self.session
        others = detached.listing(set(s.meshes))
        if not s.meshes and not others:
            print("no meshes; start one with  procs = %mesh spawn -n 4")
        for name, (procs, _c) in s.meshes.items():
            mark = "*" if name == s.current else " "
            kind = ", detached" if name in s.hosts else ""
            print(f"{mark} {name}: {n_ranks(len(procs))}, {'stopped' if procs.stopped else 'running'}{kind}")
        for line in others:
            print(line)

    def _cmd_tensors(self, _a):
        from .tensor_listing import tensor_lines

        print("\n".join(tensor_lines(self.shell.user_ns)))

    def _cmd_use(self, a):
        procs, _c = self.session.get(a.name)
        self.session.current = a.name
        print(f"mesh {a.name} is current: %%mesh cells run on its {n_ranks(len(procs))}")

    def _cmd_stop(self, a):
        procs, _c = self.session.get(a.name)
        print("\n".join(self.session.stop(procs.name)))

    def _cmd_jobs(self, _a):
        for line in self.session.jobs.listing():
            print(line)

    def _cmd_kill_job(self, a):
        s = self.session
        name, meshes = s.jobs.kill(a.name)
        for m in meshes:
            if m in s.meshes:
                proxy.forget_mesh(self.shell, m)
                s.remove(m)
        print(f"job {name} killed" + (f" with its meshes {', '.join(meshes)}" if meshes else ""))

    def _cmd_status(self, a):
        """The table once: a live widget where widgets render, its text the fallback of the
        same display (a frontend shows one of the two), else the text alone."""
        s = self.session
        procs, _consoles = s.get()
        host = s.hosts.get(procs.name)
        table = status.as_text(procs.name, status.snapshot(procs, s.last_lines, host), detached=host is not None,
                               full=a.all)
        live = s.live.get(procs.name) if host is None else None
        if live is None or live.full != a.all or live.final:  # else the same widget once more: every view stays live
            try:
                live = None if host is not None else status.LiveStatus(s, full=a.all)
            except ImportError:  # no ipywidgets: the text table is all there is
                live = None
            if live is not None:
                old = s.live.pop(procs.name, None)
                if old is not None:
                    old.close(note="not updated: a newer %mesh status is")
                s.live[procs.name] = live
        if live is None:
            print(table)
            return None
        display({**live.widget._repr_mimebundle_(), "text/plain": table}, raw=True)

    def _cmd_stacks(self, a):
        procs, _consoles = self.session.get()
        ranks = ranks_arg(a.ranks, len(procs), "RANKS") if a.ranks is not None else None
        report = procs.stacks(ranks, native=a.native, all_threads=a.all_threads, runtime_frames=a.runtime_frames,
                              method="py-spy" if a.py_spy else "auto")
        report = report.name_frames(self.session.cells.frame)
        record_stacks(report, "stacks")
        return report

    def _cmd_history(self, a):
        return history_command(self.session, a)

    def _cmd_top(self, a):
        if a.interval <= 0 or a.count < 0:
            raise UsageError("%mesh top: --interval is seconds over 0 and --count a number of refreshes; "
                             "type  %mesh top --interval 1")
        procs, _consoles = self.session.get()
        hosts = {r: str(h or "") for r, h in zip(procs.shape.ranks, procs.ref.hosts, strict=False)}
        handle = None
        n = 0
        try:
            while True:
                self.session.metrics.sample(procs)
                table = top_table(self.session.metrics, procs, hosts)
                if handle is None:
                    handle = display({"text/plain": table}, raw=True, display_id=True)
                else:
                    handle.update({"text/plain": table}, raw=True)
                n += 1
                if a.count and n >= a.count:
                    return None
                time.sleep(a.interval)
        except KeyboardInterrupt:
            return None  # the stop button ends it

    def _cmd_collectives(self, _a):
        from ..spmd.controller.collectives import collectives

        procs, _consoles = self.session.get()
        report = collectives(procs)
        if report.stacks is not None:
            report.stacks.name_frames(self.session.cells.frame)
        return report

    def _cmd_watchdog(self, a):
        if a.seconds == "off":
            self.session.watchdog.set(None)
            print("watchdog off")
            return
        try:
            seconds = float(a.seconds)
        except ValueError:
            seconds = 0.0
        if not seconds > 0:
            raise UsageError(f"%mesh watchdog {a.seconds}: give seconds (a number over 0) or off; "
                             f"type  %mesh watchdog 60")
        if a.then not in ("dump", "abort", "restart"):
            raise UsageError(f"%mesh watchdog --then {a.then}: choose dump, abort or restart; type  "
                             f"%mesh watchdog {a.seconds} --then abort")
        if a.then == "restart":
            procs, _consoles = self.session.get()
            if procs.name in self.session.hosts or not procs.restart_policy.on_failure:
                raise UsageError(f"%mesh watchdog --then restart needs a restart policy on mesh {procs.name} "
                                 "(replacing the stuck rank by itself); type  %mesh policy --restart on-failure  "
                                 f"first, or  %mesh watchdog {a.seconds} --then abort  to raise HangError and keep "
                                 "the mesh")
        self.session.watchdog.set(seconds, a.then)
        if a.then == "abort":
            print(f"watchdog on: a cell whose ranks make no progress for {seconds:g} s raises HangError "
                  "(the hung collective torn down, the mesh kept)")
        elif a.then == "restart":
            print(f"watchdog on: ranks that make no progress for {seconds:g} s are killed and replaced "
                  "under the mesh's restart policy")
        else:
            print(f"watchdog on: a cell that waits on ranks for {seconds:g} s shows their stacks")

    def _cmd_restart(self, a):
        procs, _consoles = self.session.get()
        ranks = ranks_arg(a.ranks, len(procs), "--ranks") if a.ranks is not None else None
        done = self.session.restart(procs.name, ranks)  # ProcMesh.restart: the one restart path
        record_event(procs.name, "restart", detail=f"{rank_label(done.ranks)} restarted" if done.ranks else "")
        if done.killed:
            print(f"{rank_label(done.killed)} not responding: killing, to replace")
        print(f"restarted {rank_label(done.ranks)} with fresh namespaces" if done.ranks else "no dead ranks to restart")

    def _cmd_policy(self, a):
        procs, _consoles = self.session.get(a.name)
        if procs.name in self.session.hosts:
            raise UsageError(f"mesh {procs.name} is detached: its host process owns its ranks and has no restart "
                             "policy; spawn a mesh of this kernel with  %mesh spawn -n 4 --restart on-failure")
        if a.restart is not None:
            procs.set_restart_policy(a.restart, max_restarts=a.max_restarts, restart_window=a.restart_window)
        print(policy_text(procs))

    def _cmd_sync(self, a):
        procs, _consoles = self.session.get()
        path = os.path.expanduser(a.path) if a.path else os.getcwd()
        if not os.path.isdir(path):
            raise UsageError(f"{a.path!r} is not a folder; type  %mesh sync [path]  "
                             "(a folder of your code; default: the kernel's working directory)")
        print(procs.sync_workspace(path))

    def _cmd_run(self, words):
        from ..spmd.controller.env import setup_torch_elastic_env
        from ..spmd.controller.run import console_code

        if not words or words == ["-m"]:
            raise UsageError("type  %mesh run train.py --lr 0.1  or  %mesh run -m package.train --lr 0.1")
        argv = list(words)
        if argv[0] != "-m":
            path = os.path.expanduser(argv[0])
            if not os.path.isfile(path):
                raise UsageError(f"{argv[0]}: no such file here (the kernel's directory is {os.getcwd()}); "
                                 "for a module of a synced folder type  %mesh run -m MODULE")
            argv[0] = os.path.abspath(path)
        procs, _consoles = self.session.get()
        setup_torch_elastic_env(procs)  # torchrun's variables, a fresh rendezvous port, the death watcher
        started = time.monotonic()
        run_on_mesh(self.session, console_code(argv), None, None, line=f"run {shlex.join(words)}")
        print(f"{words[0] if words[0] != '-m' else words[1]} finished on {rank_label(list(range(len(procs))))} "
              f"in {time.monotonic() - started:.1f} s")

    def _cmd_auto(self, a):
        procs, _c = self.session.get()
        self.session.auto = a.state == "on"
        transformers = self.shell.input_transformers_cleanup  # before %% magics are parsed
        if self.session.auto and _auto_transform not in transformers:
            transformers.append(_auto_transform)
        elif not self.session.auto and _auto_transform in transformers:
            transformers.remove(_auto_transform)
        print(f"auto on: every cell runs on mesh {procs.name} (%mesh lines stay here; %mesh auto off ends it)"
              if self.session.auto else "auto off: cells run here again")

    def _cmd_debug(self, words):
        proxy.command(self.session, self.shell, words)

    def _cmd_pdb(self, words):
        self.session.pdb.magic(words)

    def _cmd_push(self, a):
        values = {}
        for pair in a.pairs:
            name, eq, expr = pair.partition("=")
            if not eq or not name.isidentifier():
                raise UsageError(f"%mesh push {pair!r}: write name=expr, e.g. %mesh push lr=0.1")
            values[name] = self.shell.ev(expr) if expr else None
        procs, consoles = self.session.get()
        consoles.push.call(values).get(timeout=60)
        print(f"pushed {', '.join(values)} to {rank_label(list(range(len(procs))), brackets=False)}")

    def _cmd_pull(self, a):
        if not a.name.isidentifier():
            raise UsageError("type  %mesh pull name")
        _procs, consoles = self.session.get()
        return consoles.pull.call(a.name).get(timeout=60)

    def _cmd_scatter(self, a):
        name, eq, expr = a.pair.partition("=")
        if not eq:
            raise UsageError("type  %mesh scatter name=expr  (a list, array or tensor, split along its first dim)")
        if not name.isidentifier():
            raise UsageError(f"%mesh scatter {a.pair!r}: write name=expr")
        _procs, consoles = self.session.get()
        chunks = split_along_ranks(self.shell.ev(expr), len(consoles))
        flat = consoles.flatten("ranks")  # ranks counted across every dim (a job's mesh has hosts too)
        futs = [flat.slice(ranks=r).push.call_one({name: c}) for r, c in enumerate(chunks)]
        for f in futs:
            f.get(timeout=60)
        print(f"scattered {name}: one piece to each of {rank_label(list(range(len(chunks))), brackets=False)}")

    def _cmd_gather(self, a):
        if not a.name.isidentifier():
            raise UsageError("type  %mesh gather name")
        _procs, consoles = self.session.get()
        return join_along_ranks(list(consoles.pull.call(a.name).get(timeout=60).values()))


def n_ranks(n: int) -> str:
    """``1 rank``, ``4 ranks``."""
    return counted(n, "rank")


def _asks_help(words: list[str]) -> bool:
    """``--help`` or ``-h`` among a command's words: the user asks what to type."""
    return "--help" in words or "-h" in words


def _unknown(cmd: str, rest: str) -> str:
    """An unknown subcommand's message: the nearest one, ready to type, or the list."""
    guess = nearest(cmd)
    if guess is not None and guess != CELL:
        return (f"%mesh {cmd}: unknown command; did you mean  %mesh {guess}{' ' + rest if rest else ''}  "
                "(%mesh help lists every command)")
    return f"%mesh {cmd}: unknown command; the commands: {', '.join(COMMANDS)} (%mesh help: a line on each)"


def _auto_transform(lines: list[str]) -> list[str]:
    """With ``%mesh auto on``, send each cell to the mesh (``%mesh`` lines stay local)."""
    text = "".join(lines)
    if not text.strip() or text.lstrip().startswith(("%mesh", "%%mesh")):
        return lines
    return ["%%mesh\n", *lines]
