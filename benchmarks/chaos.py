"""chaos: a seeded schedule of faults across hosts in the middle of a mixed workload, and
the figures of what came through.  ``python -m benchmarks chaos --seed N --minutes M``.

Two simulated hosts (cluster.py's network namespaces with their own sshd, each with its
own /dev/shm) run 4 ranks each under ``SSHJob``; this process is their controller and makes
whole-mesh calls and ``call_one``s from three threads, ``RDMABuffer`` reads between the
hosts and DDP steps over gloo.  A real kernel is the controller of 4 local ranks and runs
``%%mesh`` cells that print numbered lines.  The schedule (every kind in a shuffled round,
random gaps and holds, all drawn from the seed) injects one fault at a time, undoes it,
restarts what died (``procs.restart``, ``%mesh restart``; a new job for a host whose agent is
gone) and checks that the meshes answer again and a DDP step runs after
``setup_torch_distributed()``.  At the end nothing may be left: no process on any host or
here, no file in any run directory or /dev/shm.  The run "passes" (``ok``) with 0 hangs,
0 kernel or controller deaths, 0 lost lines, 0 orphans and every recovery answered.

With ``--watchdog T`` a hang watchdog (``then="dump"``) watches both: the kernel's ``%mesh
watchdog T`` and ``spmd.HangWatch`` on the hosts' mesh; each report is counted
(``watchdog_reports``), and one with no hang of the run (a call past its bound) is a false
alarm that fails ``ok``.  With the restart policy too, the hosts' watchdog acts
(``then="restart"``: the rank a hung call waits for is replaced, and the call fails): each of
its reports must then match a call that failed after stalling T s (``stalled_then_failed``).
T should exceed the longest fault held (4 s) and a recovery.

With ``--restart-policy`` both meshes are spawned with ``restart="on-failure"``: the run never
restarts a rank itself, it waits for the runtime to replace it (``by_policy`` counts those
recoveries), on the other host when its own host's agent is gone (``relocated``).  Once the
moved mesh has answered and run a DDP step, the run starts a new job over both hosts again
(the lost host is back), so that the next faults find two hosts.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ._util import ROOT, log
from .chaos_faults import KINDS, Faults, undo_all
from .chaos_work import CALL_BOUND, DDP_BOUND, Cells, Hosts, Ledger, call_loop, ddp_agrees, ddp_loop, rdma_loop

PER_HOST = 4
KERNEL_RANKS = 4
# with the restart policy: no limit (-1), so no fault of the run is refused as a crash loop
POLICY = {"restart": "on-failure", "max_restarts": -1, "restart_window": 60.0}
SHM_SIZE = "256m"  # each host's own /dev/shm


@dataclass(frozen=True)
class Step:
    kind: str
    gap: float  # s of calm before the fault
    hold: float  # s it stays in force before it is undone


def schedule(seed: int, n: int = 2000) -> list[Step]:
    """The run's faults, from its seed alone: each round is every kind once, shuffled."""
    rng = random.Random(seed)
    steps: list[Step] = []
    while len(steps) < n:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        steps += [Step(k, round(rng.uniform(0.5, 3.0), 2), round(rng.uniform(0.5, 4.0), 2)) for k in kinds]
    return steps


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: network namespaces and sshd simulate the hosts"
    for tool in ("ip", "unshare", "nsenter", "sshd", "ssh", "ssh-keygen"):
        if not (shutil.which(tool) or os.access(f"/usr/sbin/{tool}", os.X_OK)):
            return f"{tool} is not installed"
    return None


class Run:
    def __init__(self, seed: int, seconds: float, policy: bool = False, watchdog: float = 0.0):
        self.seed, self.seconds, self.policy, self.watchdog = seed, seconds, policy, watchdog
        self.alarms: list[str] = []  # the hosts' watchdog's reports, as their first line
        self.ledger = Ledger()
        self.hosts = Hosts()
        self.stop = threading.Event()
        self.fault_counts = {k: 0 for k in KINDS}
        self.fault_log: list[str] = []
        self.recovery = {"hosts_restarted": 0, "hosts_rebuilt": 0, "answered_after": 0, "failed_after": 0,
                         "ddp_after": 0, "ddp_failed_after": 0, "by_policy": 0, "relocated": 0,
                         "rebuild_failed": 0, "ddp_retried": 0}
        self.seen_pids: set[int] = {os.getpid()}
        self.ledger.on_hang = self._hang_stacks
        self._stacks_at = 0.0  # when the hosts' ranks' stacks were last logged for a hang
        self.kernel_tree: set[int] = set()
        self.tmp = tempfile.mkdtemp(prefix=f"mk-chaos-{seed}-")
        self.run_tmp = os.path.join(self.tmp, "tmp")  # TMPDIR of every process of the run
        self.marks = os.path.join(self.tmp, "marks")
        os.makedirs(self.run_tmp)
        os.makedirs(self.marks)
        self.python = os.path.join(self.tmp, "python")
        with open(self.python, "w") as f:  # the hosts' python: the agents' run directories land in run_tmp
            f.write(f"#!/bin/sh\nTMPDIR={self.run_tmp} exec {sys.executable} \"$@\"\n")
        os.chmod(self.python, 0o755)

    # ---------------------------------------------------------------- the hosts' mesh

    def build_hosts(self, net) -> None:
        from monarch_kernel.job import SSHJob
        from monarch_kernel.spmd import setup_torch_distributed

        from ._chaos_actors import ChaosDDP, ChaosWorker

        old = self.hosts.job
        with self.hosts.lock:
            self.hosts.workers, self.hosts.ddp_ready = None, False
        if old is not None:
            old.kill()
        job = SSHJob(python_exe=self.python, ssh_args=net.ssh_args)
        job.add_mesh("hosts", net.hosts)
        procs = job.state().hosts.spawn_procs(per_host={"gpus": PER_HOST}, **(POLICY if self.policy else {}))
        workers = procs.spawn("chaos", ChaosWorker)
        ddp = procs.spawn("ddp", ChaosDDP)
        pids = list(workers.pid.call().get(timeout=CALL_BOUND).values())
        setup_torch_distributed(procs, "gloo")
        with self.hosts.lock:
            self.hosts.job, self.hosts.procs, self.hosts.workers, self.hosts.pids = job, procs, workers, pids
            self.hosts.ddp, self.hosts.ddp_ready, self.hosts.events_seen = ddp, True, 0
        self.seen_pids.update(pids)

    def _hang_stacks(self, text: str) -> None:
        """A call hung: log the hosts' ranks' states and stacks (at most once a minute, on a
        thread of its own), so that a hang is explained, not only counted."""
        now = time.monotonic()
        if now - self._stacks_at < 60:
            return
        self._stacks_at = now
        procs = self.hosts.procs

        def dump() -> None:
            try:
                states = [(s["rank"], s.get("host"), s.get("pid"), s.get("state"), s.get("silent_s"))
                          for s in procs.rank_states()]
                log(f"chaos: after {text}: the hosts' ranks {states}; their stacks:\n{procs.stacks(timeout=60)}")
            except Exception as e:  # noqa: BLE001
                log(f"chaos: after {text}: no stacks of the hosts' ranks: {type(e).__name__}: {e}")

        if procs is not None:
            threading.Thread(target=dump, name="chaos-hang-stacks", daemon=True).start()

    def heal_hosts(self, net, kind: str) -> None:
        """After a fault: the hosts' mesh answers as it is, or its dead ranks are restarted
        (moved to the other host by the policy, or a new job without one, when a host's agent is
        gone); then a DDP step after setting up again."""
        h = self.hosts
        if kind in ("kill_agent", "link_down"):
            time.sleep(3.5)  # a host's death is declared within 3 s; a short cut may be survived
        elif kind == "sigkill_rank":
            time.sleep(0.5)
        answered = self.ledger.run("verify", CALL_BOUND, lambda: h.workers.echo.call(-1),
                                   lambda v: list(v.values()) == [-1] * len(v))
        dead = h.procs.dead_ranks()
        restarted = self.policy and self._policy_restarts(h)  # replaced already, with nobody asking
        if answered is not None and not dead and not restarted:
            return
        with h.lock:
            h.ddp_ready = False
        with h.ddp_turn:  # a DDP step sent before the fault ends first (Hosts.ddp_turn)
            self._recover(net, h, dead, answered)

    def _recover(self, net, h, dead, answered) -> None:
        """``heal_hosts`` once the mesh is known hurt: its ranks replaced (or a new job), the
        group set up again, a DDP step; no other DDP step runs meanwhile."""
        from monarch_kernel.spmd import setup_torch_distributed

        from ._chaos_actors import ChaosDDP, ChaosWorker

        agents = all(any(_is_agent(p) for p in net.pids(host)) for host in net.hosts)
        t0, rebuilt, moved = time.monotonic(), False, False
        try:
            if not agents and not self.policy:
                raise RuntimeError("a host's agent is gone")
            if self.policy:  # a lost host's ranks are moved by the policy to the other one
                if dead or answered is None or not agents:
                    self._replaced_by_policy(h)
                self._policy_restarts(h)
                self.recovery["by_policy"] += 1
                moved = len({row["host"] for row in h.procs.rank_states()}) < len(net.hosts)
                self.recovery["relocated"] += moved
            else:
                h.procs.restart(None, [(h.workers, ChaosWorker, (), {}), (h.ddp, ChaosDDP, (), {})], timeout=120)
            self.recovery["hosts_restarted"] += 1
            pids = list(h.workers.pid.call().get(timeout=CALL_BOUND).values())
            with h.lock:
                h.pids = pids
            self.seen_pids.update(pids)
        except Exception as e:
            log(f"chaos: restart of the hosts' mesh: {type(e).__name__}: {e}; a new job")
            self.build_hosts(net)  # sets the group up too
            self.recovery["hosts_rebuilt"] += 1
            rebuilt = True
        got = self.ledger.run("verify", CALL_BOUND, lambda: h.workers.echo.call(-2),
                              lambda v: list(v.values()) == [-2] * 8)
        self.recovery["answered_after" if got is not None else "failed_after"] += 1
        t1 = time.monotonic()
        if not rebuilt:
            try:
                setup_torch_distributed(h.procs, "gloo")
            except Exception as e:
                log(f"chaos: setup_torch_distributed after the restart: {type(e).__name__}: {e}")
        t2 = time.monotonic()
        step = self.ledger.run("ddp_after_restart", DDP_BOUND, lambda: h.ddp.ddp_step.call(), ddp_agrees)
        if step is None and self.policy and not rebuilt:  # the watchdog replaced a broken rank: again, once
            self.recovery["ddp_retried"] += 1
            try:
                self._replaced_by_policy(h)
                self._policy_restarts(h)
                pids = list(h.workers.pid.call().get(timeout=CALL_BOUND).values())
                with h.lock:
                    h.pids = pids
                self.seen_pids.update(pids)
                setup_torch_distributed(h.procs, "gloo")
            except Exception as e:  # noqa: BLE001
                log(f"chaos: setting the group up again for the retried step: {type(e).__name__}: {e}")
            step = self.ledger.run("ddp_after_restart", DDP_BOUND, lambda: h.ddp.ddp_step.call(), ddp_agrees)
        what = "new job" if rebuilt else "moved to the other host" if moved else "restart"
        log(f"chaos: {what} {t1 - t0:.1f} s, setup_torch_distributed {t2 - t1:.1f} s, "
            f"first DDP step {time.monotonic() - t2:.1f} s")
        self.recovery["ddp_after" if step is not None else "ddp_failed_after"] += 1
        if step is None:  # what each rank is doing, for the log: a hang is explained, not only counted
            try:
                log(f"chaos: the hosts' ranks after the failed DDP step:\n{h.procs.stacks(timeout=60)}")
            except Exception as e:  # noqa: BLE001
                log(f"chaos: no stacks of the hosts' ranks: {type(e).__name__}: {e}")
        if moved:  # the lost host is back: a job over both again, for the next faults
            self._rebuild(net)
        with h.lock:
            h.ddp_ready = True

    def _rebuild(self, net, tries: int = 3) -> None:
        """``build_hosts``, again if it fails (counted and logged: a job whose host was lost
        while it was set up, with no fault in force, is a finding, not the end of the run)."""
        for i in range(tries):
            try:
                self.build_hosts(net)
                self.recovery["hosts_rebuilt"] += 1
                return
            except Exception as e:  # noqa: BLE001
                self.recovery["rebuild_failed"] += 1
                log(f"chaos: building the hosts' job again failed (try {i + 1} of {tries}): {type(e).__name__}: {e}")
        raise RuntimeError(f"the hosts' job could not be built again in {tries} tries (see the log)")

    def _replaced_by_policy(self, h) -> None:
        """Wait (no restart asked) until the policy has replaced every dead rank and the mesh answers."""
        deadline = time.monotonic() + 120
        while True:
            if not h.procs.dead_ranks():
                try:
                    if list(h.workers.echo.call(-3).get(timeout=CALL_BOUND).values()) == [-3] * len(h.pids):
                        break
                except Exception:  # noqa: BLE001  (a rank still being replaced: ask again)
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the restart policy did not replace ranks {h.procs.dead_ranks()} in 120 s")
            time.sleep(0.2)

    def _policy_restarts(self, h) -> bool:
        """Whether the policy restarted ranks of the hosts' mesh since the last time asked."""
        n = len(h.procs.events())
        seen, h.events_seen = h.events_seen, n
        return n > seen

    # ---------------------------------------------------------------- the run

    def rank_pids(self, cells) -> list[int]:
        with self.hosts.lock:
            return list(self.hosts.pids) + list(cells.pids)

    def local_pids(self, km) -> list[int]:
        out = {os.getpid()} | self.kernel_tree
        try:
            import psutil

            out |= {c.pid for c in psutil.Process().children(recursive=True)}
        except Exception:
            pass
        return sorted(out)

    def watch(self, km) -> None:
        import psutil

        kpid = _kernel_pid(km)
        while not self.stop.wait(1.0):
            self.ledger.overdue()
            try:
                tree = psutil.Process(kpid).children(recursive=True) if kpid else []
                self.kernel_tree |= {p.pid for p in tree}
                self.seen_pids |= {p.pid for p in psutil.Process().children(recursive=True)} | self.kernel_tree
            except psutil.Error:
                pass

    def main(self) -> dict:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from jupyter_client.manager import start_new_kernel
        from support import cluster  # the tests' simulated hosts

        from monarch_kernel.kernel.kernelspec import KERNEL_NAME

        started = time.monotonic()
        with cluster.ssh_network(2, shm_size=SHM_SIZE) as net:
            os.environ["TMPDIR"] = self.run_tmp  # every later process's, and this one's run directory
            tempfile.tempdir = None
            self.build_hosts(net)
            km, kc = start_new_kernel(kernel_name=KERNEL_NAME, startup_timeout=120)
            cells = Cells(km, kc, KERNEL_RANKS, self.ledger, self.marks, policy=self.policy)
            try:
                policy = f" --restart on-failure --max-restarts {POLICY['max_restarts']}" if self.policy else ""
                got = cells.execute(f"procs = %mesh spawn -n {KERNEL_RANKS}{policy}", 180)
                if got is None or got[0] != "ok" or not cells.read_pids():
                    raise RuntimeError(f"the kernel's mesh did not start: {got}")
                if self.watchdog:
                    got = cells.execute(f"%mesh watchdog {self.watchdog:g}", 60)
                    if got is None or got[0] != "ok":
                        raise RuntimeError(f"%mesh watchdog {self.watchdog:g} failed: {got}")
                result = self._chaos(net, km, kc, cells, started)
            finally:
                self.stop.set()
                try:
                    if km.is_alive():
                        cells.execute("%mesh stop", 60)
                finally:
                    kc.stop_channels()
                    km.shutdown_kernel(now=False)
            with self.hosts.lock:
                job = self.hosts.job
            if job is not None:
                job.kill()
            result["orphans"] = self.orphans(net)
        result["elapsed_s"] = round(time.monotonic() - started, 1)
        result["ok"] = (result["hangs"] == 0 and result["kernel_deaths"] == 0 and result["lines_lost"] == 0
                        and result["orphans"]["processes"] == 0 and result["orphans"]["files"] == 0
                        and result["recovery"]["failed_after"] == 0 and result["recovery"]["ddp_failed_after"] == 0
                        and result["recovery"]["rebuild_failed"] == 0
                        and result["kernel_restarts_answered"] == result["kernel_restarts"]
                        and (result["hangs"] > 0 or not any(result["watchdog_reports"].values())
                             or (self.policy and result["stalled_then_failed"] >= result["watchdog_reports"]["hosts"]
                                 and not result["watchdog_reports"]["kernel"])))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return result

    def _chaos(self, net, km, kc, cells, started) -> dict:
        rng = random.Random(self.seed)
        threads = [threading.Thread(target=call_loop, args=(self.ledger, self.hosts, random.Random(rng.random()),
                                                             self.stop), name=f"chaos-calls-{i}", daemon=True)
                   for i in range(3)]
        threads += [threading.Thread(target=fn, args=(self.ledger, self.hosts, random.Random(rng.random()), self.stop),
                                     name=fn.__name__, daemon=True) for fn in (rdma_loop, ddp_loop)]
        threads += [threading.Thread(target=cells.loop, args=(self.stop,), name="chaos-cells", daemon=True),
                    threading.Thread(target=self.watch, args=(km,), name="chaos-watch", daemon=True)]
        for t in threads:
            t.start()
        watch = None
        if self.watchdog:
            from monarch_kernel.spmd import HangWatch

            # Under the restart policy nobody watches: a hang is ended by replacing the rank it
            # waits for (its interpreter may be what is broken: an import cut by EMFILE leaves a
            # package half-imported for good), and the recovery below sets the group up again.
            self.ledger.stall_s = self.watchdog
            watch = HangWatch(self.watchdog, "restart" if self.policy else "dump", on_report=self._alarm,
                              meshes=lambda: [p for p in (self.hosts.procs,) if p is not None]).start()
        faults = Faults(net, lambda: self.rank_pids(cells), lambda: self.local_pids(km), random.Random(self.seed + 1))
        active: list = []
        started = time.monotonic()  # the faults' clock starts once everything is up
        end = started + self.seconds
        try:
            for step in schedule(self.seed):
                if self.stop.wait(step.gap) or time.monotonic() > end or cells.dead.is_set():
                    break
                kernel_hit = set(cells.pids)
                at = time.monotonic()
                what, state = faults.inject(step.kind)
                self.fault_counts[step.kind] += 1
                line = f"{at - started:6.1f} s {step.kind}: {what}, held {step.hold} s"
                log(f"chaos: {line}")
                active.append((step.kind, state))
                self.stop.wait(step.hold)
                undo_all(faults, active)
                healed = time.monotonic()
                if step.kind in ("sigkill_rank", "fds_exhausted") and isinstance(state, int | tuple) and \
                        (state if isinstance(state, int) else state[0]) in kernel_hit:
                    if not cells.restart(timeout=240):
                        log("chaos: the kernel's mesh did not answer after %mesh restart in 240 s")
                self.heal_hosts(net, step.kind)
                line += f" (in force {healed - at:.1f} s, recovered in {time.monotonic() - healed:.1f} s)"
                self.fault_log.append(line)
                log(f"chaos: {line}")
        finally:
            undo_all(faults, active)
            self.stop.set()
            for t in threads:  # the watchdog watches on: a call hung as the faults end is theirs too
                t.join(timeout=DDP_BOUND + 30)
            if watch is not None:
                watch.stop()
        fig = self.ledger.figures()
        b = cells.books
        return {"seed": self.seed, "seconds": self.seconds, "restart_policy": self.policy,
                "faults": dict(self.fault_counts),
                "faults_total": sum(self.fault_counts.values()), **fig,
                "kernel_deaths": b.kernel_deaths + (0 if km.is_alive() else 1), "controller_deaths": 0,
                "cells": b.cells, "cells_ok": b.cells_ok, "cells_error": b.cells_error,
                "lines_printed": b.lines_expected, "lines_seen": b.lines_seen, "lines_lost": b.lines_lost,
                "lines_duplicated": b.lines_duplicated, "lines_out_of_order": b.lines_out_of_order,
                "kernel_restarts": b.restarts, "kernel_restarts_answered": b.restarts_answered,
                "recovery": dict(self.recovery), "watchdog_s": self.watchdog,
                "watchdog_reports": {"hosts": len(self.alarms), "kernel": b.watchdog_reports},
                "watchdog_alarms": self.alarms[:20], "fault_log": self.fault_log[:200]}

    def _alarm(self, report) -> None:
        """The hosts' watchdog found calls without progress for its T: logged and counted
        (with the fault in force, if any, in the log just above it)."""
        lines = report.lines()
        log("chaos: the hosts' watchdog reported:\n" + "\n".join(lines[:40]))
        self.alarms.append(lines[0] if lines else repr(report))

    # ---------------------------------------------------------------- what is left

    def orphans(self, net) -> dict:
        import psutil

        from monarch_kernel.runtime.process import Runtime

        found: list[str] = []
        left = net.net.leftovers({p.pid for p in net.sshd}, 10.0)
        for ns, text in left.items():
            found += [f"[{ns}] {line}" for line in text.splitlines()]
        daemons = {p.pid for p in net.sshd}  # the hosts' sshd listeners stay until the network goes
        mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in daemons and _alive(p)]
        deadline = time.monotonic() + 10
        while mine and time.monotonic() < deadline:
            time.sleep(0.2)
            mine = [p for p in mine if _alive(p)]
        for p in mine + [psutil.Process(pid) for pid in self.kernel_tree if _alive_pid(pid)]:
            with _quiet():
                found.append(f"[here] pid {p.pid}: {' '.join(p.cmdline())[:160]}")
                p.kill()
        files: list[str] = []
        for host in net.hosts:
            files += [f"{host}:/dev/shm/{n}" for n in net.in_host(host, "ls -A /dev/shm").stdout.split()]
        ours = {f"mk-{pid}-" for pid in self.seen_pids}
        files += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in ours)]
        rt = Runtime.existing()
        own = os.path.realpath(rt.rundir) if rt is not None else None
        for dirpath, _dirs, names in os.walk(self.run_tmp):
            if own is not None and os.path.realpath(dirpath).startswith(own):
                continue  # this controller's own run directory: it goes when this process ends
            files += [os.path.join(dirpath, n) for n in names]
        return {"processes": len(found), "files": len(files), "list": (found + files)[:40]}


def _is_agent(pid: int) -> bool:
    import psutil

    try:
        return "monarch_kernel.agent" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _kernel_pid(km) -> int | None:
    prov = getattr(km, "provisioner", None)
    proc = getattr(prov, "process", None)
    return getattr(proc, "pid", None)


def _alive(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _alive_pid(pid: int) -> bool:
    import psutil

    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import psutil

        return exc[0] is not None and issubclass(exc[0], psutil.Error)


def chaos() -> dict:
    """The benchmark job: seed and length from MK_CHAOS_SEED / MK_CHAOS_SECONDS (set by
    ``python -m benchmarks chaos --seed N --minutes M``)."""
    reason = _skip_reason()
    if reason:
        return {"chaos_skipped": reason}
    seed = int(os.environ.get("MK_CHAOS_SEED", "1"))
    seconds = float(os.environ.get("MK_CHAOS_SECONDS", "600"))
    result = Run(seed, seconds, policy=bool(os.environ.get("MK_CHAOS_POLICY")),
                 watchdog=float(os.environ.get("MK_CHAOS_WATCHDOG") or 0)).main()
    log(f"chaos: {result}")
    return {"chaos": result}
