"""The chaos run's workload and its books (chaos.py drives them): every call is entered in
the ``Ledger`` with its bound before it is made and leaves it resolved (a value or an
exception); one still pending past its bound is a hang.  Worker threads make whole-mesh
``call``s and ``call_one``s, ``RDMABuffer`` reads between the hosts and DDP steps on the
hosts' mesh; one thread drives ``%%mesh`` cells through a real kernel and checks that each
rank's numbered lines arrive once, in order, none lost.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field

from ._util import log

CALL_BOUND = 60.0  # s: an echo; a SIGSTOPped rank is continued within 6 s, a dead host fails in 3 s
RDMA_BOUND = 90.0
DDP_BOUND = 180.0  # the first step after a restart imports torch on 8 ranks of a loaded machine
CELL_BOUND = 120.0
CELL_LINES = 20
LINE = re.compile(r"^\[rank (\d+)\] L (\d+) (\d+) (\d+)$")
PID_LINE = re.compile(r"^\[rank (\d+)\] PID (\d+)$")


class Ledger:
    """Calls made, resolved (with a value or an exception, by type) and hung."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.pending: dict[int, tuple[str, float, float]] = {}  # id -> (what, started, bound)
        self.made = collections.Counter()
        self.values = collections.Counter()
        self.errors = collections.Counter()  # "what: ExceptionType"
        self.first: dict[str, str] = {}  # "what: ExceptionType" -> the first one's message
        self.wrong = collections.Counter()  # resolved with a value that is not the right one
        self.hangs: list[str] = []
        self.hung: set[int] = set()
        self.stall_s = 0.0  # the hang watchdog's T (0: none): a call failed after this long had stalled
        self.stalled = 0  # calls that failed after stalling past it (a watchdog that ends hangs ended them)
        self.on_hang = None  # called with each hang's text (outside the lock): the run logs where the ranks are

    def run(self, what: str, bound: float, make, check=None):
        """``make()`` returns a Future; wait for it up to ``bound`` s.  Returns the value, or
        None when it raised or hung."""
        with self.lock:
            cid = next(self.ids)
            self.pending[cid] = (what, time.monotonic(), bound)
            self.made[what] += 1
        try:
            fut = make()
            value = fut.get(timeout=bound)
        except TimeoutError as e:
            if "fut" in locals() and not fut.done():  # noqa: F821 - still pending past its bound: a hang
                self._hang(cid, f"{what}: pending after {bound:.0f} s")
                return None
            self._error(cid, what, e)
            return None
        except Exception as e:
            self._error(cid, what, e)
            return None
        with self.lock:
            self.pending.pop(cid, None)
            self.values[what] += 1
            if check is not None and not check(value):
                self.wrong[what] += 1
                log(f"chaos: {what} answered a wrong value: {value!r:.200}")
        return value

    def _error(self, cid: int, what: str, e: BaseException) -> None:
        with self.lock:
            made = self.pending.pop(cid, None)
            if made is not None and self.stall_s and time.monotonic() - made[1] >= self.stall_s:
                self.stalled += 1
            key = f"{what}: {type(e).__name__}"
            self.errors[key] += 1
            self.first.setdefault(key, str(e)[:300])

    def _hang(self, cid: int, text: str) -> None:
        with self.lock:
            self.pending.pop(cid, None)
            if cid not in self.hung:
                self.hung.add(cid)
                self.hangs.append(text)
        log(f"chaos: HANG {text}")
        if self.on_hang is not None:
            self.on_hang(text)

    def overdue(self, slack: float = 30.0) -> None:
        """Record as hangs the calls whose ``make()`` itself has not returned past bound + slack."""
        now = time.monotonic()
        with self.lock:
            late = [(cid, w) for cid, (w, t, b) in self.pending.items() if now - t > b + slack and cid not in self.hung]
            for cid, what in late:
                self.hung.add(cid)
                self.hangs.append(f"{what}: not even sent after its bound")
        for _cid, what in late:
            log(f"chaos: HANG {what} (the call did not return)")

    def figures(self) -> dict:
        with self.lock:
            resolved = sum(self.values.values()) + sum(self.errors.values())
            return {"calls_made": sum(self.made.values()), "calls_resolved": resolved,
                    "calls_pending": len(self.pending) - len([c for c in self.pending if c in self.hung]),
                    "calls_by_kind": dict(self.made), "values_by_kind": dict(self.values),
                    "exceptions": dict(self.errors), "first_exceptions": dict(self.first),
                    "wrong_values": sum(self.wrong.values()),
                    "hangs": len(self.hangs), "hang_list": self.hangs[:20], "stalled_then_failed": self.stalled}


@dataclass
class Hosts:
    """The hosts' mesh as it is now (rebuilt after a host dies): ``workers`` on ``procs``,
    their pids, and whether DDP's group is set up.  Read under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    job: object = None
    procs: object = None
    workers: object = None
    ddp: object = None  # the DDP actor mesh on procs
    pids: list[int] = field(default_factory=list)
    ddp_ready: bool = False
    events_seen: int = 0  # the restart policy's events of procs counted so far (--restart-policy)
    # Held by a DDP step in flight, and by a recovery from its "not ready" until the group is
    # set up again: a step sent just before a fault must end before the group is rebuilt, or
    # some ranks run it in the new group and the others do not (collectives from two threads
    # of the controller have no order between them, on any system).
    ddp_turn: threading.Lock = field(default_factory=threading.Lock)

    def current(self):
        with self.lock:
            return self.workers, self.ddp_ready

    def current_ddp(self):
        with self.lock:
            return self.ddp if self.ddp_ready else None


def call_loop(ledger: Ledger, hosts: Hosts, rng: random.Random, stop: threading.Event) -> None:
    """Whole-mesh calls and one-rank calls, as fast as they resolve."""
    i = 0
    while not stop.is_set():
        workers, _ = hosts.current()
        if workers is None:
            stop.wait(0.1)
            continue
        i += 1
        if rng.random() < 0.5:
            ledger.run("call", CALL_BOUND, lambda w=workers, i=i: w.echo.call(i),
                       lambda v, i=i: list(v.values()) == [i] * len(v))
        else:
            h, g = rng.randrange(2), rng.randrange(4)
            one = workers.slice(hosts=h, gpus=g)
            ledger.run("call_one", CALL_BOUND, lambda one=one, i=i: one.echo.call_one(i), lambda v, i=i: v == i)
        stop.wait(rng.random() * 0.05)


def rdma_loop(ledger: Ledger, hosts: Hosts, rng: random.Random, stop: threading.Event) -> None:
    """A buffer made on a rank of one host, read by a rank of the other; the CRCs agree."""
    while not stop.is_set():
        workers, _ = hosts.current()
        if workers is None:
            stop.wait(0.1)
            continue
        src = rng.randrange(2)
        owner = workers.slice(hosts=src, gpus=rng.randrange(4))
        reader = workers.slice(hosts=1 - src, gpus=rng.randrange(4))
        made = ledger.run("rdma_make", CALL_BOUND, lambda owner=owner: owner.make.call_one(1 << 20))
        if made is not None:
            buf, crc = made
            ledger.run("rdma_read", RDMA_BOUND, lambda reader=reader, buf=buf: reader.read.call_one(buf, 30.0),
                       lambda v, crc=crc: v == crc)
        stop.wait(0.2 + rng.random() * 0.5)


def ddp_loop(ledger: Ledger, hosts: Hosts, rng: random.Random, stop: threading.Event) -> None:
    """A DDP step on the hosts' mesh every few seconds, while its group is set up."""
    while not stop.wait(2 + rng.random() * 4):
        with hosts.ddp_turn:
            ddp = hosts.current_ddp()
            if ddp is not None:
                ledger.run("ddp_step", DDP_BOUND, lambda d=ddp: d.ddp_step.call(), ddp_agrees)


def ddp_agrees(v) -> bool:
    got = list(v.values())
    return len(got) == 8 and all(g == got[0] for g in got) and got[0][0] == 8


# ------------------------------------------------------------------------- the kernel


# What the kernel's %mesh watchdog prints in a cell when it finds no progress.
WATCHDOG_SAID = "%mesh watchdog: the cell has waited"


@dataclass
class CellBooks:
    cells: int = 0
    cells_ok: int = 0
    cells_error: int = 0
    lines_expected: int = 0  # lines the ranks recorded as printed
    lines_seen: int = 0
    lines_lost: int = 0
    lines_duplicated: int = 0
    lines_out_of_order: int = 0
    restarts: int = 0
    restarts_answered: int = 0
    kernel_deaths: int = 0
    watchdog_reports: int = 0  # reports of the kernel's %mesh watchdog shown in the cells


class Cells:
    """Runs numbered-line ``%%mesh`` cells through kernel client ``kc`` (only this thread
    touches it) on the kernel's mesh of ``n`` ranks; ``restart()`` asks it for a
    ``%mesh restart`` and waits until the mesh answered again."""

    def __init__(self, km, kc, n: int, ledger: Ledger, marks: str, policy: bool = False):
        self.km, self.kc, self.n, self.ledger, self.marks = km, kc, n, ledger, marks
        self.policy = policy  # the mesh has a restart policy: a dead rank is replaced without %mesh restart
        self.books = CellBooks()
        self.pids: list[int] = []
        self._want_restart = threading.Event()
        self._restarted = threading.Event()
        self.dead = threading.Event()

    def execute(self, code: str, bound: float = CELL_BOUND) -> tuple[str, str, str] | None:
        """Run ``code``; (status, stdout text, stderr and error text) or None if it did not
        finish within ``bound``.  The streams are kept apart: the kernel's stderr carries
        text captured from its file descriptor 2 in chunks that need not end a line (a
        traceback logged when garbage reaches a Jupyter port), and one such chunk joined to
        the stdout that follows it would hide that stdout's first line."""
        cid = next(self.ledger.ids)
        with self.ledger.lock:
            self.ledger.made["cell"] += 1
        msg_id = self.kc.execute(code)
        out: list[str] = []
        err: list[str] = []
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except Exception:  # queue.Empty
                if not self.km.is_alive():
                    self.dead.set()
                    self.books.kernel_deaths += 1
                    return None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
                if WATCHDOG_SAID in content["text"]:
                    self.books.watchdog_reports += content["text"].count(WATCHDOG_SAID)
                    log(f"chaos: the kernel's watchdog reported: {content['text'][:400]!r}")
            elif kind == "error":
                err.append("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                reply = self.kc.get_shell_msg(timeout=30)
                status = reply["content"]["status"]
                with self.ledger.lock:
                    self.ledger.values["cell"] += 1
                return status, "".join(out), "".join(err)
        self.ledger._hang(cid, f"cell: no idle status after {bound:.0f} s: {code[:60]!r}")
        self.km.interrupt_kernel()
        return None

    def read_pids(self) -> bool:
        got = self.execute("%%mesh\nimport os\nprint('PID', os.getpid())")
        if got is None:
            return False
        pids = {int(m[1]): int(m[2]) for line in got[1].splitlines() if (m := PID_LINE.match(line))}
        if len(pids) == self.n:
            self.pids = [pids[r] for r in range(self.n)]
            return True
        return False

    def restart(self, timeout: float) -> bool:
        self._restarted.clear()
        self._want_restart.set()
        return self._restarted.wait(timeout)

    def loop(self, stop: threading.Event) -> None:
        for k in itertools.count():
            if stop.is_set() or self.dead.is_set():
                return
            if self._want_restart.is_set():
                self._want_restart.clear()
                self._do_restart()
                self._restarted.set()
                continue
            self.cell(k)

    def _do_restart(self) -> None:
        self.books.restarts += 1
        if self.policy:  # nothing typed: the runtime replaces the rank; wait until every rank answers
            deadline = time.monotonic() + 120
            while not self.read_pids():
                if time.monotonic() > deadline:
                    log("chaos: the restart policy did not bring the kernel's mesh back in 120 s")
                    return
                time.sleep(0.2)
            self.books.restarts_answered += 1
            return
        got = self.execute("%mesh restart")
        if got is not None and got[0] != "ok":
            log(f"chaos: %mesh restart said: {(got[1] + got[2])[-400:]}")
        if self.read_pids():
            self.books.restarts_answered += 1

    def cell(self, k: int) -> None:
        code = ("%%mesh\nimport time\nfrom monarch_kernel import current_rank\n"
                "_r = current_rank().rank\n"
                f"with open(f'{self.marks}/c{k}-r{{_r}}', 'w') as _f:\n"
                f"    for _i in range({CELL_LINES}):\n"
                f"        print(f'L {k} {{_r}} {{_i}}', flush=True)\n"
                "        _f.write(f'{_i}\\n'); _f.flush()\n"
                "        time.sleep(0.02)\n")
        got = self.execute(code)
        b = self.books
        b.cells += 1
        if got is None:
            return
        status, text, err = got
        if status == "ok":
            b.cells_ok += 1
        else:
            b.cells_error += 1
        seen: dict[int, list[int]] = {r: [] for r in range(self.n)}
        for line in text.splitlines():
            m = LINE.match(line)
            if m and int(m[2]) == k and int(m[1]) == int(m[3]) and int(m[1]) in seen:
                seen[int(m[1])].append(int(m[4]))
        for r, idx in seen.items():
            printed = _count_lines(f"{self.marks}/c{k}-r{r}")
            b.lines_expected += printed
            b.lines_seen += len(idx)
            b.lines_duplicated += len(idx) - len(set(idx))
            b.lines_out_of_order += sum(1 for a, c in zip(idx, idx[1:], strict=False) if c < a)
            lost = len(set(range(printed)) - set(idx))
            if lost:
                odd = [line for line in (text + err).splitlines() if f"L {k} {r} " in line and not LINE.match(line)]
                log(f"chaos: cell {k} rank {r}: {lost} of {printed} printed lines never arrived (got {idx}); "
                    f"lines that hold one but are not one: {odd[:3]!r}")
            b.lines_lost += lost
            if status == "ok" and printed != CELL_LINES:
                log(f"chaos: cell {k} ok but rank {r} recorded {printed} lines")


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            n = sum(1 for line in f if line.endswith("\n"))
        os.unlink(path)
        return n
    except OSError:
        return 0
