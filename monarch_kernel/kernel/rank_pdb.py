"""Distributed pdb, rank side: ``breakpoint()`` / ``pdb.set_trace()`` on a rank (in a
``%%mesh`` cell or a sync actor endpoint) and post-mortem stops talk to the notebook.

pdb's stdout is a port to the controller (what the rank prints); its stdin is a channel
opened in the rank, whose port travels in the ``Stopped`` message (what the user typed).
Input arrives on the rank's IO thread, never through an actor whose thread is stopped.  A session never
outlives the code it stopped: when the frame it was started in returns, tracing ends.
It must never block the rank's IO loop, so it refuses to start there.
"""

from __future__ import annotations

import bdb
import itertools
import linecache
import pdb
import sys
import threading
from dataclasses import dataclass, field

from ..actor.actor import Actor
from ..actor.endpoint import endpoint

RELEASE = "\x00release"  # in place of a typed line: nobody will answer, run on
POLL_S = 0.1  # how often a waiting rank checks for input (and lets an interrupt in)


@dataclass
class Stopped:
    """A session began: where, and which files the rank has no source for."""

    mesh: str
    rank: int
    session: int
    filename: str
    lineno: int
    function: str
    reason: str  # "breakpoint" or "post-mortem"
    cell: bool  # the frame is a %%mesh cell run on this rank
    error: str = ""  # for post-mortem: the exception, one line
    missing: tuple = ()
    reply: object = None  # Port: send (line, sources) here


@dataclass
class Prompt:
    """The rank waits for a pdb command; ``output`` is what pdb printed since the last one."""

    mesh: str
    rank: int
    session: int
    output: str
    lineno: int = 0
    filename: str = ""


@dataclass
class Resumed:
    """The rank runs again: ``stepping`` if it will stop again by itself (n, s, r, unt)."""

    mesh: str
    rank: int
    session: int
    output: str
    stepping: bool


@dataclass
class Ended:
    """The session is over (the code it stopped returned, or the user quit)."""

    mesh: str
    rank: int
    session: int
    output: str = ""


@dataclass
class _Config:
    port: object = None  # monarch_kernel Port of the controller's pdb hub
    post_mortem: bool = False
    cell_files: set = field(default_factory=set)


config = _Config()
_ids = itertools.count(1)
_active: set = set()  # sessions that have not ended


def configure(port=None, post_mortem: bool | None = None) -> None:
    if port is not None:
        old = config.port
        config.port = port
        if old is not None and (old.address, old.port_id) != (port.address, port.port_id):
            # Another kernel took over (a detached mesh re-attached): the one these
            # sessions talked to is gone, so nobody would ever answer them.  Run on.
            threading.Thread(target=_release_all, name="pdb-release", daemon=True).start()
    if post_mortem is not None:
        config.post_mortem = post_mortem
        from ..runtime.process import Runtime

        # Sync endpoints of every actor on this rank, not only %%mesh cells.
        Runtime.endpoint_error_hook = staticmethod(_endpoint_post_mortem) if post_mortem else None


def _endpoint_post_mortem(error: Exception) -> None:
    if isinstance(error, bdb.BdbQuit):
        return
    tb = error.__traceback__
    while tb is not None and _internal(tb.tb_frame):
        tb = tb.tb_next  # start at the user's code, not the runtime's
    if tb is not None:
        post_mortem(tb, error)


def _release_all() -> None:
    for p in list(_active):
        p._reply_port.send((RELEASE, {}))


def install() -> None:
    """Route ``breakpoint()`` and ``pdb.set_trace()`` on this rank to the notebook."""
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace


def breakpointhook(*_args, **_kwargs) -> None:
    _start(sys._getframe(1))


def set_trace(*, header=None) -> None:
    _start(sys._getframe(1), header)


def _start(frame, header=None) -> None:
    if "debugpy" in sys.modules:
        import debugpy

        if debugpy.is_client_connected():  # a DAP client is attached: let it take the stop
            debugpy.breakpoint()
            return
    why = _cannot_stop()
    if why:
        print(f"breakpoint() ignored: {why}", file=sys.stderr, flush=True)
        return
    p = RankPdb()
    if header is not None:
        p.message(header)
    p.set_trace(frame)


def post_mortem(tb, error: BaseException) -> None:
    """Stop at the frame that raised ``error`` (``tb`` without the console's frames)."""
    if _cannot_stop() or getattr(error, "_monarch_post_mortem", False):
        return
    try:
        error._monarch_post_mortem = True  # once: the endpoint hook sees it again
    except AttributeError:
        pass
    p = RankPdb(reason="post-mortem", error=f"{type(error).__name__}: {error}")
    p.reset()
    try:
        p.interaction(None, tb)
    finally:
        p._end()


def _cannot_stop() -> str:
    if config.port is None:
        return "this rank has no notebook to talk to (run a %%mesh cell first)"
    from ..runtime.process import Runtime

    rt = Runtime._current
    if rt is not None and rt.io.is_current():
        return ("it would block this rank's event loop (an async endpoint); use a sync endpoint, "
                "or JupyterLab's debugger via %mesh debug RANK")
    return ""


def _internal(frame) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("monarch_kernel.")


class _Out:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


class _In:
    def __init__(self, owner: "RankPdb"):
        self.owner = owner

    def readline(self) -> str:
        return self.owner._read_line()


class RankPdb(pdb.Pdb):
    """A pdb whose terminal is the notebook, reached through the controller's port."""

    def __init__(self, reason: str = "breakpoint", error: str = ""):
        self._out = _Out()
        super().__init__(stdin=_In(self), stdout=self._out, nosigint=True, readrc=False)
        self.use_rawinput = False
        self.prompt = "(Pdb) "
        self.session = next(_ids)
        self.reason, self.error = reason, error
        from ..actor.port import Channel

        self._reply_port, self._replies = Channel.open()
        self._next = None  # the Future of the next reply, kept across interrupted waits
        self._announced = False
        self._ended = False
        from ..runtime.context import process_mesh

        mesh, rank = process_mesh
        self.mesh_name, self.rank = (mesh.name if mesh is not None else ""), rank
        _active.add(self)

    # -- where the session starts and ends

    def set_trace(self, frame=None):
        """Trace from ``frame`` up to the outermost user frame only, never the runtime's."""
        self.reset()
        while frame is not None and not _internal(frame):
            frame.f_trace = self.trace_dispatch
            self.botframe = frame
            frame = frame.f_back
        self.set_step()
        sys.settrace(self.trace_dispatch)

    def dispatch_return(self, frame, arg):
        result = super().dispatch_return(frame, arg)
        if frame is self.botframe:
            self._end()
            return None
        return result

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        _active.discard(self)
        if self.reason != "post-mortem":
            sys.settrace(None)
            self._set_stopinfo(self.botframe, None, -1)
        self._send(Ended(self.mesh_name, self.rank, self.session, self._out.take()))

    # -- talking to the controller

    def _send(self, msg) -> None:
        try:
            config.port.send(msg)
        except Exception as e:  # the controller is gone: run on rather than hang
            print(f"pdb on rank {self.rank}: cannot reach the notebook ({e}); continuing", file=sys.stderr)
            raise bdb.BdbQuit from e

    def _wait(self):
        """The next (line, sources) from the notebook; the kernel's stop button ends the session."""
        try:
            while True:
                if self._next is None:
                    self._next = self._replies.recv()
                try:
                    value = self._next.get(timeout=POLL_S)
                except TimeoutError:
                    continue
                self._next = None
                return value
        except KeyboardInterrupt:
            self._end()
            raise

    def interaction(self, frame, traceback):
        if not self._announced:
            self._announced = True
            f = frame if frame is not None else _last_frame(traceback)
            missing = tuple({fr.f_code.co_filename for fr, _ in self._frames(frame, traceback)
                             if not linecache.getlines(fr.f_code.co_filename, fr.f_globals)})
            self._send(Stopped(self.mesh_name, self.rank, self.session, f.f_code.co_filename,
                               f.f_lineno if frame is not None else _last_lineno(traceback),
                               f.f_code.co_name, self.reason, f.f_code.co_filename in config.cell_files,
                               self.error, missing, self._reply_port))
            line, sources = self._wait()  # the controller answers with the sources we lacked
            if line == RELEASE:
                self.set_continue()
                self._end()
                return
            for name, text in sources.items():
                linecache.cache[name] = (len(text), None, text.splitlines(True), name)
        super().interaction(frame, traceback)

    def _frames(self, frame, tb):
        stack, _i = self.get_stack(frame, tb)
        return [(f, n) for f, n in stack if not _internal(f)]

    def _cmdloop(self):
        # No '--KeyboardInterrupt--' loop: the kernel's stop button must end the cell.
        self.cmdloop()

    def _read_line(self) -> str:
        text = self._out.take()
        if text.endswith(self.prompt):
            text = text[: -len(self.prompt)]
        frame = self.curframe
        self._send(Prompt(self.mesh_name, self.rank, self.session, text,
                          frame.f_lineno if frame is not None else 0,
                          frame.f_code.co_filename if frame is not None else ""))
        line, _sources = self._wait()
        return "EOF\n" if line in (None, RELEASE) else line + "\n"

    def postloop(self):
        if self.reason == "post-mortem":
            return  # post_mortem() ends the session once the traceback is left
        stepping = not self.quitting and self.stoplineno != -1
        if stepping or (self.breaks and not self.quitting):
            self._send(Resumed(self.mesh_name, self.rank, self.session, self._out.take(), stepping))
        else:
            self._end()  # continue without breakpoints, or quit: nothing can stop it again

    def do_EOF(self, arg):
        """The notebook has no stdin (or the user sent EOF): continue."""
        return self.do_continue(arg)


def _last_frame(tb):
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def _last_lineno(tb) -> int:
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_lineno



class PdbSetup(Actor):
    """Spawned by the kernel on meshes made with the API in a cell (those made with
    ``%mesh spawn`` get a console, which does the same): routes this rank's ``breakpoint()``
    to the notebook."""

    def __init__(self, port, post_mortem: bool):
        install()
        configure(port, post_mortem)

    @endpoint
    async def debug_setup(self, pdb_port=None, post_mortem: bool | None = None) -> None:
        configure(pdb_port, post_mortem)
