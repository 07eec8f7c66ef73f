"""Distributed pdb, rank side: ``breakpoint()`` / ``pdb.set_trace()`` on a rank (in a
``%%mesh`` cell or a sync actor endpoint) and post-mortem stops talk to the notebook.

Runs in rank processes.  pdb's stdout is a port to the kernel's pdb hub (what the rank
prints); its stdin is a channel opened in the rank, whose port travels in ``Stopped`` (what
the user typed), so input arrives on the rank's IO thread, never through an actor whose
thread is stopped.  A session never outlives the code it stopped: when the frame it was
started in returns, tracing ends.  It must never block the rank's IO loop, so it refuses to
start there; and nothing is hooked until ``install()`` / ``configure()`` are called.
"""

from __future__ import annotations

import bdb
import itertools
import linecache
import logging
import pdb
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ...actor.actor import Actor
from ...actor.endpoint import endpoint
from ...actor.port import Channel
from ...runtime import Runtime, process_mesh
from ...runtime import config as settings
from ..messages import RELEASE, Ended, Prompt, Reply, Resumed, Stopped

log = logging.getLogger(__name__)
POLL_S = settings.seconds("pdb_rank_poll")


@dataclass
class Config:
    """This rank's pdb settings, as the kernel last sent them."""

    port: Any = None  # monarch_kernel Port of the kernel's pdb hub
    post_mortem: bool = False
    cell_files: set = field(default_factory=set)  # files of %%mesh cells run here


config = Config()
_ids = itertools.count(1)
_active: set = set()  # sessions that have not ended
_handles: dict = {}  # what install() / configure() put in place: name -> hooks.Handle
_handles_lock = threading.Lock()


def configure(port=None, post_mortem: bool | None = None) -> None:
    """Where this rank's sessions report (the kernel's pdb hub), and whether an error in a
    cell or a sync endpoint stops in pdb; None leaves a setting as it is."""
    if port is not None:
        old = config.port
        config.port = port
        if old is not None and (old.address, old.port_id) != (port.address, port.port_id):
            # Another kernel took over (a detached mesh re-attached): the one these
            # sessions talked to is gone, so nobody would ever answer them.  Run on.
            threading.Thread(target=_release_all, name="pdb-release", daemon=True).start()
    if post_mortem is not None:
        config.post_mortem = post_mortem
        # Sync endpoints of every actor on this rank, not only %%mesh cells.
        with _handles_lock:
            handle = _handles.get("endpoint_error")
            if post_mortem and handle is None:
                _handles["endpoint_error"] = Runtime.current().hooks.endpoint_error.install(_endpoint_post_mortem)
            elif not post_mortem and handle is not None:
                _handles.pop("endpoint_error").remove()


def install() -> None:
    """Route ``breakpoint()`` and ``pdb.set_trace()`` on this rank to the notebook (once)."""
    hooks = Runtime.current().hooks
    with _handles_lock:
        if "breakpointhook" not in _handles:
            _handles["breakpointhook"] = hooks.patch(sys, "breakpointhook", breakpointhook)
        if "set_trace" not in _handles:
            _handles["set_trace"] = hooks.patch(pdb, "set_trace", set_trace)


def uninstall() -> None:
    """Undo ``install()`` and the post-mortem hook."""
    with _handles_lock:
        handles = list(_handles.values())
        _handles.clear()
    for h in handles:
        h.remove()


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
        p.release()


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
        log.warning("breakpoint() ignored: %s", why)
        return
    p = RankPdb()
    if header is not None:
        p.message(header)
    p.set_trace(frame)


# Set on an exception once it stopped in post-mortem pdb: the endpoint hook sees it again.
POST_MORTEM_MARK = "__monarch_post_mortem__"


def post_mortem(tb, error: BaseException, force: bool = False) -> str:
    """Stop at the frame that raised ``error`` (``tb`` without the console's frames); once per
    error, unless ``force`` (``%debug`` asks again for an error that stopped already).
    Returns why it could not stop ("" when it did, or had before)."""
    why = _cannot_stop()
    if why or (getattr(error, POST_MORTEM_MARK, False) and not force):
        return why
    try:
        setattr(error, POST_MORTEM_MARK, True)
    except AttributeError:
        pass
    p = RankPdb(reason="post-mortem", error=f"{type(error).__name__}: {error}")
    p.reset()
    try:
        p.interaction(None, tb)
    finally:
        p.end()
    return ""


def _cannot_stop() -> str:
    if config.port is None:
        return "this rank has no notebook to talk to (run a %%mesh cell first)"
    rt = Runtime.existing()
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
    def __init__(self, owner: RankPdb):
        self.owner = owner

    def readline(self) -> str:
        return self.owner.read_line()


class RankPdb(pdb.Pdb):
    """A pdb whose terminal is the notebook, reached through the kernel's pdb hub."""

    def __init__(self, reason: str = "breakpoint", error: str = ""):
        self._out = _Out()
        # pdb only reads lines from stdin and writes to stdout: these file-likes suffice.
        super().__init__(stdin=_In(self), stdout=self._out, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = "(Pdb) "
        self.session = next(_ids)
        self.reason, self.error_text = reason, error  # not .error: that is pdb's own method
        self.reply_port: Any
        self._replies: Any
        self.reply_port, self._replies = Channel.open()  # the kernel's Reply messages come here
        self._next: Any = None  # the Future of the next reply, kept across interrupted waits
        self._announced = False
        self._ended = False
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
            self.end()
            return None
        return result

    def end(self) -> None:
        """End the session (once): stop tracing and tell the kernel."""
        if self._ended:
            return
        self._ended = True
        _active.discard(self)
        if self.reason != "post-mortem":
            sys.settrace(None)
            self._set_stopinfo(self.botframe, None, -1)  # type: ignore[attr-defined]  # bdb's own: never stop again
        self._send(Ended(self.mesh_name, self.rank, self.session, self._out.take()))

    def release(self) -> None:
        """Answer this session's own prompt with ``RELEASE``: it runs on (no kernel will)."""
        self.reply_port.send(Reply(RELEASE).encode())

    # -- talking to the kernel

    def _send(self, msg) -> None:
        try:
            config.port.send(msg.encode())
        except Exception as e:  # the kernel is gone: run on rather than hang
            log.warning("pdb on rank %s: cannot reach the notebook (%s); continuing", self.rank, e)
            raise bdb.BdbQuit from e

    def _wait(self) -> Reply:
        """The next Reply from the notebook; the kernel's stop button ends the session."""
        try:
            while True:
                if self._next is None:
                    self._next = self._replies.recv()
                try:
                    value = self._next.get(timeout=POLL_S)
                except TimeoutError:
                    continue
                self._next = None
                return Reply.decode(value)
        except KeyboardInterrupt:
            self.end()
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
                               self.error_text, missing, self.reply_port))
            reply = self._wait()  # the kernel answers with the sources we lacked
            if reply.line == RELEASE:
                self.set_continue()
                self.end()
                return
            for name, text in reply.sources.items():
                linecache.cache[name] = (len(text), None, text.splitlines(True), name)
        super().interaction(frame, traceback)

    def _frames(self, frame, tb):
        stack, _i = self.get_stack(frame, tb)
        return [(f, n) for f, n in stack if not _internal(f)]

    def _cmdloop(self):
        # pdb's own hook, overridden: no '--KeyboardInterrupt--' loop, the kernel's stop
        # button must end the cell.
        self.cmdloop()

    def read_line(self) -> str:
        """pdb's next input line: tell the kernel we wait (with what pdb printed), then wait."""
        text = self._out.take()
        if text.endswith(self.prompt):
            text = text[: -len(self.prompt)]
        frame = self.curframe
        self._send(Prompt(self.mesh_name, self.rank, self.session, text,
                          frame.f_lineno if frame is not None else 0,
                          frame.f_code.co_filename if frame is not None else ""))
        line = self._wait().line
        return "EOF\n" if line in (None, RELEASE) else line + "\n"

    def postloop(self):
        if self.reason == "post-mortem":
            return  # post_mortem() ends the session once the traceback is left
        stepping = not self.quitting and self.stoplineno != -1
        if stepping or (self.breaks and not self.quitting):
            self._send(Resumed(self.mesh_name, self.rank, self.session, self._out.take(), stepping))
        else:
            self.end()  # continue without breakpoints, or quit: nothing can stop it again

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
