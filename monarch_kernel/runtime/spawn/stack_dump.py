"""Every thread's stack of some ranks, for ``%mesh stacks``: taken from outside by py-spy
(run by each rank's template or host agent), or by the rank itself when py-spy cannot.

Both ways give the same shape, py-spy's ``dump --json``: a list of threads, each
``{"thread_id", "thread_name", "active", "owns_gil", "frames": [{"name", "filename",
"line"}, ...]}`` with the innermost frame first.  ``sample`` runs in the process that
spawned the mesh; ``on_stacks`` on a rank, on its IO thread (the rank's own dump, which
needs the IO thread to get the GIL now and then); ``ask`` in any process that may call
the mesh, a detached one included.
"""

from __future__ import annotations

import json
import sys
import threading
import types

from ..completion import Completion
from ..context import MeshRef
from ..wire.envelope import Header, Kind, Part, Status, join_parts
from ..wire.payloads import StacksAsk
from ..wire.serialize import dumps
from .host_messages import StackDump


class PendingDumps:
    """The ``StackDump``s a template client or an agent link still waits for, by tag."""

    def __init__(self):
        self._waiting: dict[int, list] = {}  # tag -> [on_dump, pids still to come]

    def add(self, tag: int, n: int, on_dump) -> None:
        self._waiting[tag] = [on_dump, n]

    def drop(self, tag: int) -> None:
        self._waiting.pop(tag, None)

    def arrived(self, msg: StackDump) -> None:
        waiting = self._waiting.get(msg.tag)
        if waiting is None:
            return
        waiting[1] -= 1
        if waiting[1] <= 0:
            del self._waiting[msg.tag]
        waiting[0](msg)


def sample(rt, om, ranks: list[int], native: bool) -> Completion:
    """py-spy each of ``ranks`` of a mesh this process spawned (``om``: its ``OwnedMesh``),
    from any thread: a completion of ``{rank: StackDump}`` (status -1: no dump, and ``err``
    says why), done once every rank has answered."""
    got = Completion()
    dumps_: dict[int, StackDump] = {}

    def check() -> None:
        if len(dumps_) >= len(ranks) and not got.done():
            got.set_result(dict(dumps_))

    def go() -> None:
        forkers: dict[int, tuple] = {}
        for r in ranks:
            pid = om.pids[r]
            forker = (om.links[r] if om.links is not None
                      else rt.launcher.templates.get(om.sources[r] or ""))
            if pid is None or r not in om.alive or forker is None:
                why = "the rank is not running" if forker is not None or pid is None else "its template is gone"
                dumps_[r] = StackDump(0, pid or 0, -1, b"", why.encode())
                continue
            forkers.setdefault(id(forker), (forker, {}))[1][pid] = r
        for forker, by_pid in forkers.values():
            def on_dump(d: StackDump, by_pid=by_pid) -> None:
                if d.pid in by_pid:
                    dumps_[by_pid[d.pid]] = d
                    check()
            forker.stacks(list(by_pid), native, on_dump)
        check()

    rt.io.call_soon(go)
    return got


def threads_now() -> list[dict]:
    """This process's threads and their stacks, in py-spy's JSON shape."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out: list[dict] = []
    for ident, top in sys._current_frames().items():
        frames = []
        frame: types.FrameType | None = top
        while frame is not None:  # innermost first; qualified names, as py-spy gives them
            code = frame.f_code
            frames.append({"name": getattr(code, "co_qualname", code.co_name), "filename": code.co_filename,
                           "line": frame.f_lineno or 0})
            frame = frame.f_back
        out.append({"thread_id": ident, "thread_name": names.get(ident, ""), "active": ident == me,
                    "owns_gil": ident == me, "frames": frames})
    return out


def on_stacks(rt, h: Header, _body: list) -> None:
    """On a rank's IO thread: answer a STACKS with this process's own dump."""
    if not isinstance(h.payload, StacksAsk):
        rt.drops.count("malformed")
        return
    member = rt.memberships.get(h.mesh)
    me = member[1] if member is not None else -1
    data = json.dumps(threads_now()).encode()
    rt.outbox.send_port(h.payload.address, h.payload.port, Part(me, Status.OK, dumps(data)), mesh_id=h.mesh)


def ask(rt, mesh: MeshRef, ranks: list[int], timeout: float) -> dict[int, bytes]:
    """Ask each of ``ranks`` for its own dump (``on_stacks``); ``{rank: JSON}`` of those that
    answered within ``timeout`` seconds (a rank stuck holding the GIL cannot)."""
    got: dict[int, bytes] = {}
    done = threading.Event()
    want = {r for r in ranks if rt.death(mesh.id, r) is None}

    def hear(part: Part) -> None:
        value = part.load()
        if isinstance(value, bytes) and part.rank in want:
            got[part.rank] = value
            if want <= set(got):
                done.set()

    port_id = rt.ports.open(hear, once=False)
    try:
        for r in want:
            me = rt.network.answerable(rt.inbox, mesh.addresses[r])
            h = Header.control(Kind.STACKS, me, mesh.id, [r], payload=StacksAsk(me, port_id))
            rt.outbox.send_or_report(mesh.addresses[r], h, join_parts(h, []), f"a stacks request for rank {r}")
        if want:
            done.wait(timeout)
    finally:
        rt.ports.close(port_id)
    return dict(got)
