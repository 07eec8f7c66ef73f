"""Helpers for tests that drive real kernels with jupyter_client: the one IOPub collector
(``iopub(kc)``: every message a client's IOPub channel delivers, kept in arrival order, a
cell's outputs read from them as typed ``Output``s), ``run`` for a whole cell, and kernels
started and shut down around a block.

Every wait here is bounded, and its failure says what it waited for.
"""

from __future__ import annotations

import contextlib
import queue
import re
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import KernelManager

from monarch_kernel.kernel.kernelspec import KERNEL_NAME, install

T = TypeVar("T")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
OUTPUT_KINDS = ("stream", "execute_result", "display_data", "error")  # what a notebook stores


@dataclass(frozen=True)
class Message:
    """One IOPub message, as it arrived."""

    msg_type: str
    parent_id: str  # msg_id of the request it belongs to ("" when none)
    content: dict
    at: float  # time.monotonic() when the collector read it


@dataclass(frozen=True)
class Output:
    """One output of a cell, as a notebook stores it: ``kind`` is one of ``OUTPUT_KINDS``;
    ``text`` is a stream's text, a bundle's text/plain, or an error's traceback (ANSI colours
    removed), so tests match on what a reader sees."""

    kind: str
    text: str
    at: float = 0.0  # arrival (time.monotonic()); 0.0 for outputs read from a notebook file
    name: str = ""  # the stream's name (stdout, stderr)
    data: dict = field(default_factory=dict)  # the mime bundle of displays and results
    metadata: dict = field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, content: Any, at: float = 0.0) -> Output | None:
        """The output an IOPub message's content (or a notebook's output node) stands for;
        None for messages that are not outputs (status, comm_msg, update_display_data...)."""
        if kind == "stream":
            return cls(kind, content["text"], at, name=content["name"])
        if kind in ("execute_result", "display_data"):
            data = dict(content["data"])
            return cls(kind, data.get("text/plain", ""), at, data=data, metadata=dict(content.get("metadata", {})))
        if kind == "error":
            return cls(kind, ANSI.sub("", "\n".join(content["traceback"])), at)
        return None

    @classmethod
    def from_notebook(cls, node) -> Output | None:
        """An output node of a notebook (nbformat v4) that nbclient filled in."""
        return cls.of(node["output_type"], node)


def text(outputs: Iterable[Output]) -> str:
    """The outputs' text as a notebook shows it: consecutive stream outputs of one name merged,
    and their ``\\r`` and ``\\b`` applied (``as_shown``); each output that follows starts on a
    line of its own, as in a notebook (stdout's last line, not ended, is not continued by stderr)."""
    parts: list[str] = []
    run: list[str] = []
    name = None
    for o in outputs:
        if o.kind == "stream" and o.name == name:
            run.append(o.text)
            continue
        if run:
            parts.append(as_shown("".join(run)))
        run, name = ([o.text], o.name) if o.kind == "stream" else ([], None)
        if o.kind != "stream":
            parts.append(o.text)
    if run:
        parts.append(as_shown("".join(run)))
    parts = [p for p in parts if p]
    return "".join(p if p.endswith("\n") or i == len(parts) - 1 else p + "\n" for i, p in enumerate(parts))


def said_by(shown: str, line: str) -> list[int]:
    """The ranks that printed ``line``, each as often as it did, read from the prefixed lines of
    ``shown`` (``[rank 2] line`` and ``[ranks 0-1,3] line``).  Collapsing across ranks waits a
    window for the others' copy, so a rank slow to print it (a loaded machine) stands alone:
    this counts who said it however the lines were grouped.  (A line that overwrote the cell's
    progress line ends in the spaces that blanked it.)"""
    from monarch_kernel.runtime import parse_ranks

    ranks: list[int] = []
    for m in re.finditer(r"^\[ranks? ([\d,-]+)\] " + re.escape(line) + " *$", shown, re.M):
        ranks.extend(parse_ranks(m.group(1), 1 << 16))
    return sorted(ranks)


def as_shown(stream: str) -> str:
    """A stream's text after JupyterLab's rules (``processText`` in @jupyterlab/outputarea):
    text overwrites at a cursor, ``\\r`` moves it to the line's start, ``\\b`` deletes the
    character before it (not past a newline), ``\\n`` starts a line at the end."""
    out: list[str] = []
    cur = 0
    for ch in stream:
        if ch == "\n":
            out.append("\n")
            cur = len(out)
        elif ch == "\r":
            while cur > 0 and out[cur - 1] != "\n":
                cur -= 1
        elif ch == "\b":
            if cur > 0 and out[cur - 1] != "\n":
                del out[cur - 1]
                cur -= 1
        elif cur < len(out):
            out[cur] = ch
            cur += 1
        else:
            out.append(ch)
            cur += 1
    return "".join(out)


class IOPub:
    """Every IOPub message one client receives, in arrival order, so several readers (a
    cell's run, a wait for a widget update, a debug event) never take messages from each
    other.  Get a client's collector with ``iopub(kc)``; it only reads when asked (``pump``
    and the waits), as jupyter_client's channels are not thread-safe."""

    def __init__(self, kc):
        self.kc = kc
        self.messages: list[Message] = []
        self._by_parent: dict[str, list[Message]] = {}
        self._idle: set[str] = set()

    def pump(self, wait: float = 0.05) -> int:
        """Read every message that has arrived, waiting up to ``wait`` s for the first one;
        returns how many were read."""
        n = 0
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=wait if n == 0 else 0)
            except queue.Empty:
                return n
            m = Message(msg["msg_type"], msg["parent_header"].get("msg_id", ""), msg["content"], time.monotonic())
            self.messages.append(m)
            self._by_parent.setdefault(m.parent_id, []).append(m)
            if m.msg_type == "status" and m.content["execution_state"] == "idle":
                self._idle.add(m.parent_id)
            n += 1

    def of(self, msg_id: str, *msg_types: str) -> list[Message]:
        """The messages of request ``msg_id`` (only those of ``msg_types``, if given)."""
        got = self._by_parent.get(msg_id, [])
        return [m for m in got if m.msg_type in msg_types] if msg_types else list(got)

    def outputs(self, msg_id: str) -> list[Output]:
        """The outputs of cell ``msg_id`` seen so far, in arrival order."""
        return [o for m in self._by_parent.get(msg_id, [])
                if (o := Output.of(m.msg_type, m.content, m.at)) is not None]

    def idle(self, msg_id: str) -> bool:
        """Whether the kernel has finished request ``msg_id`` (its idle status arrived)."""
        return msg_id in self._idle

    def events(self, name: str) -> list[dict]:
        """The contents of the ``debug_event`` messages named ``name`` seen so far."""
        return [m.content for m in self.messages
                if m.msg_type == "debug_event" and m.content.get("event") == name]

    def wait(self, what: str, predicate: Callable[[], T], timeout: float,
             also: Callable[[], None] | None = None, detail: Callable[[], str] | None = None) -> T:
        """Read messages until ``predicate()`` is truthy and return it; ``also()`` runs on
        each round (to answer stdin, say).  Fails with "timed out after T s waiting for
        WHAT", followed by ``detail()`` when given."""
        deadline = time.monotonic() + timeout
        while not (got := predicate()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                                     + (f"\n{detail()}" if detail is not None else ""))
            if also is not None:
                also()
            self.pump(min(left, 0.05 if also is not None else 0.5))
        return got

    def so_far(self, msg_id: str) -> Callable[[], str]:
        """A ``detail`` for ``wait``: cell ``msg_id``'s output so far."""
        return lambda: f"output so far:\n{text(self.outputs(msg_id))}"

    def wait_idle(self, msg_id: str, timeout: float = 60, also: Callable[[], None] | None = None) -> list[Output]:
        """Wait for cell ``msg_id`` to finish; its outputs."""
        self.wait("the cell to finish (its idle status)", lambda: self.idle(msg_id), timeout, also,
                  self.so_far(msg_id))
        return self.outputs(msg_id)

    def wait_output(self, msg_id: str, needle: str, timeout: float = 30) -> Output:
        """Wait for an output of cell ``msg_id`` that contains ``needle``; that output."""
        return self.wait(f"an output containing {needle!r}",
                         lambda: next((o for o in self.outputs(msg_id) if needle in o.text), None), timeout,
                         detail=self.so_far(msg_id))


_collectors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def iopub(kc) -> IOPub:
    """The one collector of client ``kc``'s IOPub messages."""
    got = _collectors.get(kc)
    if got is None:
        got = _collectors[kc] = IOPub(kc)
    return got


def reply_to(kc, msg_id: str, timeout: float = 60) -> dict:
    """The content of the shell reply to request ``msg_id`` (late replies to earlier
    requests are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out after {timeout} s waiting for the shell reply to {msg_id}"
        try:
            reply = kc.get_shell_msg(timeout=left)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


class Ran(NamedTuple):
    """A finished cell: its outputs and its execute_reply's content."""

    outputs: list[Output]
    reply: dict

    @property
    def text(self) -> str:
        return text(self.outputs)


def run(kc, code: str, timeout: float = 60) -> Ran:
    """Execute ``code`` and wait for it to finish; unpacks as ``outputs, reply``."""
    msg_id = kc.execute(code)
    outputs = iopub(kc).wait_idle(msg_id, timeout)
    return Ran(outputs, reply_to(kc, msg_id, timeout))


def ensure_kernelspec() -> str:
    try:
        KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        install(prefix=sys.prefix)
    return KERNEL_NAME


_PORT_TAKEN = "Address already in use"
_STDERR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # manager -> its kernel's stderr file


def started(manager: Callable[[], Any], timeout: float = 60, **start) -> tuple[Any, Any]:
    """A new kernel manager's kernel, started, and its client once the kernel answers.

    jupyter_client picks free tcp ports and the kernel binds them a moment later: a port
    another process took in between (a rank's own ephemeral port, on a busy machine) kills
    the kernel at start ("Kernel died before replying to kernel_info", seen in CI).  Such a
    start, told by the kernel's stderr, is tried again with new ports, up to three times;
    any other death is raised at once.  Unless ``start`` names a ``stderr``, the kernel's
    goes to a file whose text ``finished`` writes to this process's stderr."""
    for attempt in range(3):
        km = manager()
        log = None
        if "stderr" not in start:
            log = tempfile.TemporaryFile(mode="w+b")
            _STDERR[km] = log
        km.start_kernel(**start, **({"stderr": log} if log is not None else {}))
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=timeout)
            return km, kc
        except RuntimeError:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            said = _said(km)
            if _PORT_TAKEN not in said or attempt == 2:
                raise
            print(f"the kernel's port was taken before it bound it; starting it again\n{said}",
                  file=sys.stderr)
    raise AssertionError("unreachable")


def _said(km) -> str:
    """What a kernel started by ``started`` wrote to its stderr file (and closes that)."""
    log = _STDERR.pop(km, None)
    if log is None or log.closed:
        return ""
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.close()
    return text


def finished(km, kc) -> None:
    """Shut a kernel from ``started`` down (and wait for it); its stderr to this process's."""
    kc.stop_channels()
    km.shutdown_kernel(now=False)
    sys.stderr.write(_said(km))


def stacks_of_tree(pid: int) -> str:
    """Every Python thread's stack in process ``pid`` and its descendants (a kernel, its
    templates and ranks), by py-spy from outside: what a test prints when a cell hangs."""
    import os
    import shutil
    import subprocess

    import psutil

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as e:
        return f"(no stacks: {e})"
    parts = []
    for p in procs:
        try:
            head = f"==== pid {p.pid} ({p.status()}, {p.num_threads()} threads, cpu {sum(p.cpu_times()[:2]):.1f} s): " \
                   f"{' '.join(p.cmdline())[:160]}"
        except psutil.Error:
            continue
        try:
            # --native: a thread stuck in C (a lock a fork carried, a futex) shows where, not just its Python caller
            got = subprocess.run([spy, "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True,
                                 timeout=30)
            parts.append(f"{head}\n{got.stdout}{got.stderr[-500:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"{head}\n(py-spy: {e})")
    return "\n".join(parts)


@contextlib.contextmanager
def kernel(name: str, **start):
    """A started kernel's client; the kernel is shut down (and waited for) on exit.
    ``start``: for ``KernelManager.start_kernel`` (``extra_arguments=``, ``env=``)."""
    km, client = started(lambda: KernelManager(kernel_name=name), **start)
    try:
        yield client
    finally:
        finished(km, client)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids, timeout: float, message: str) -> None:
    """Wait up to ``timeout`` s for every pid to exit (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
