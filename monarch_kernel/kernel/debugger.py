"""JupyterLab's debugger on any rank: ``MeshDebugger`` is ipykernel's debugger that, after
``%mesh debug R``, hands the frontend's DAP session to rank R's debugpy.

Requests arrive on the control channel as ``debug_request``; with a rank chosen they go
to that rank's debugpy over TCP (``dap.DapConnection``) and its events come back as
``debug_event``.  The Jupyter extras (``dumpCell``, ``debugInfo``, ``inspectVariables``,
``richInspectVariables``, ``copyToGlobals``) are answered for the rank.  Switching ranks
repeats the frontend's handshake (initialize, attach, breakpoints) on the new target, and
is refused while the current one is stopped, so no rank is ever left suspended.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import os
import threading
import uuid
from dataclasses import dataclass, field

from ipykernel.compiler import get_file_name, get_tmp_directory, get_tmp_hash_seed
from ipykernel.debugger import Debugger
from IPython.core.error import UsageError

from ..actor.errors import ActorError
from . import rank_debug
from .dap import DapConnection

REPLY_TIMEOUT_S = 60.0
INSPECT_TIMEOUT_S = 5.0  # the variable panel asks often: never hold the other requests up long
_inspectors: dict = {}  # (mesh id, rank) -> (Inspector actor, the rank's debugpy port)


def response(request: dict, success: bool = True, body: dict | None = None, message: str = "") -> dict:
    out = {"type": "response", "seq": request.get("seq", 0), "request_seq": request.get("seq", 0),
           "success": success, "command": request.get("command", "")}
    if body is not None:
        out["body"] = body
    if message:
        out["message"] = message
    return out


@dataclass
class FrontendState:
    """What the frontend (JupyterLab) set up, so a new target can be given the same."""

    initialize: dict | None = None
    attach: dict | None = None
    exceptions: dict | None = None
    breakpoints: dict = field(default_factory=dict)  # source path -> setBreakpoints arguments
    attached: bool = False

    def record(self, msg: dict) -> None:
        cmd, args = msg.get("command"), msg.get("arguments") or {}
        if cmd == "initialize":
            self.initialize = dict(args)
        elif cmd == "attach":
            self.attach, self.attached = dict(args), True
        elif cmd == "setExceptionBreakpoints":
            self.exceptions = dict(args)
        elif cmd == "setBreakpoints":
            self.breakpoints[args["source"]["path"]] = dict(args)
        elif cmd == "disconnect":
            self.initialize, self.attach, self.attached = None, None, False
            self.breakpoints.clear()


class RankTarget:
    """One rank's debugpy, driven for the frontend.  Blocking; run off the control loop."""

    def __init__(self, inspector, mesh: str, rank: int, address: tuple[str, int], publish):
        self.inspector = inspector  # this rank's Inspector actor: answers while the console is busy
        self.mesh, self.rank = mesh, rank
        self.address = address
        self._publish = publish
        self.current = True  # events reach the frontend only while this is the target
        self.conn: DapConnection | None = None
        self.capabilities: dict | None = None
        self.attached = False
        self.stopped_threads: set = set()
        self.breakpoints: dict = {}  # path -> [{"line": n}] as debugpy placed them
        self._initialized: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.RLock()

    @property
    def label(self) -> str:
        return f"rank {self.rank} of mesh '{self.mesh}'"

    # -- connection

    def _on_event(self, msg: dict) -> None:
        event, body = msg.get("event"), msg.get("body") or {}
        if event == "initialized" and not self._initialized.done():
            self._initialized.set_result(msg)
        elif event == "stopped":
            self.stopped_threads.add(body.get("threadId"))
        elif event == "continued":
            if body.get("allThreadsContinued", True):
                self.stopped_threads.clear()
            else:
                self.stopped_threads.discard(body.get("threadId"))
        if self.current:
            self._publish(msg)

    def _on_close(self) -> None:
        self.stopped_threads.clear()
        self.attached = False
        self.conn = None

    def _request(self, command: str, arguments: dict | None = None) -> dict:
        conn = self.conn
        if conn is None:
            raise ConnectionError(f"not connected to {self.label}'s debugger")
        return conn.request(command, arguments).result(REPLY_TIMEOUT_S)

    def connect(self, initialize_args: dict | None) -> dict:
        with self._lock:
            if self.conn is None:
                self.conn = DapConnection(*self.address, self._on_event, self._on_close)
                self._initialized = concurrent.futures.Future()
                self.attached = False
                self.capabilities = self._request("initialize", initialize_args or {
                    "clientID": "monarch-kernel", "adapterID": "python", "pathFormat": "path",
                    "linesStartAt1": True, "columnsStartAt1": True})
            return self.capabilities

    def attach(self, args: dict | None, state: FrontendState) -> dict:
        """Attach, then give debugpy the frontend's breakpoints before configurationDone."""
        with self._lock:
            if self.attached:
                return {"success": True}
            args = dict(args or {})
            args["connect"] = {"host": self.address[0], "port": self.address[1]}
            args.setdefault("justMyCode", False)
            # Never step into the runtime's own frames (worker loop, console plumbing).
            args["rules"] = [*args.get("rules", []), {"path": rank_debug.package_dir(), "include": False}]
            pending = self.conn.request("attach", args)
            self._initialized.result(REPLY_TIMEOUT_S)
            for bp_args in state.breakpoints.values():
                self.set_breakpoints(bp_args)
            if state.exceptions is not None:
                self._request("setExceptionBreakpoints", state.exceptions)
            self._request("configurationDone")
            reply = pending.result(REPLY_TIMEOUT_S)
            self.attached = reply.get("success", False)
            return reply

    def set_breakpoints(self, args: dict) -> dict:
        reply = self._request("setBreakpoints", args)
        if reply.get("success"):
            self.breakpoints[args["source"]["path"]] = [
                {"line": bp["line"]} for bp in reply.get("body", {}).get("breakpoints", []) if "line" in bp]
        return reply

    def disconnect(self) -> None:
        """Leave the rank running: debugpy resumes it and drops our breakpoints."""
        with self._lock:
            if self.conn is not None:
                try:
                    self._request("disconnect", {"restart": False, "terminateDebuggee": False})
                except (ConnectionError, concurrent.futures.TimeoutError):
                    pass
                if self.conn is not None:
                    self.conn.close()
            self.conn = None
            self.attached = False
            self.stopped_threads.clear()
            self.breakpoints.clear()

    # -- requests from the frontend

    def handle(self, msg: dict, state: FrontendState) -> dict:
        cmd, args = msg["command"], msg.get("arguments") or {}
        try:
            handler = getattr(self, f"_do_{cmd}", None)
            if handler is not None:
                reply = handler(msg, args, state)
            else:
                reply = self._forward(msg)
        except (ConnectionError, OSError, concurrent.futures.TimeoutError) as e:
            reply = response(msg, False, message=f"{self.label}: {e}. Type  %mesh debug off  to debug "
                                                 f"the kernel again, or  %mesh debug {self.rank}  to reconnect.")
        except Exception as e:  # a failed call to the rank: answer the frontend, keep the kernel
            reply = response(msg, False, message=f"{self.label}: {type(e).__name__}: {e}")
        reply["request_seq"] = msg.get("seq", 0)
        reply["seq"] = msg.get("seq", 0)
        reply["command"] = cmd
        return reply

    def _forward(self, msg: dict) -> dict:
        return self._request(msg["command"], msg.get("arguments"))

    def _do_initialize(self, msg, args, _state):
        return dict(self.connect(args))

    def _do_attach(self, msg, args, state):
        if self.conn is None:
            self.connect(state.initialize)
        return self.attach(args, state)

    def _do_configurationDone(self, msg, _args, _state):
        return response(msg)  # sent during attach, once the breakpoints were set

    def _do_setBreakpoints(self, msg, args, _state):
        return self.set_breakpoints(args)

    def _do_disconnect(self, msg, _args, _state):
        self.disconnect()
        return response(msg)

    def _do_dumpCell(self, msg, args, _state):
        code = args["code"]
        path = get_file_name(code)
        rank_debug.write_source(path, code)
        if self.address[0] not in ("127.0.0.1", "localhost", "::1") and not self.stopped_threads:
            # Another host: put the file there too (a stopped console cannot take the call;
            # the rank writes each cell it runs itself anyway).
            self.inspector.write_source.call_one(path, code).get(timeout=INSPECT_TIMEOUT_S)
        return response(msg, body={"sourcePath": path})

    def _do_debugInfo(self, msg, _args, _state):
        return response(msg, body={
            "isStarted": self.attached,
            "hashMethod": "Murmur2",
            "hashSeed": get_tmp_hash_seed(),
            "tmpFilePrefix": get_tmp_directory() + os.sep,
            "tmpFileSuffix": ".py",
            "breakpoints": [{"source": p, "breakpoints": b} for p, b in self.breakpoints.items()],
            "stoppedThreads": sorted(t for t in self.stopped_threads if t is not None),
            "richRendering": True,
            "exceptionPaths": ["Python Exceptions"],
            "copyToGlobals": True,
        })

    def _do_source(self, msg, args, _state):
        path = (args.get("source") or {}).get("path", "")
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return response(msg, body={"content": f.read()})
        return self._forward(msg)

    def _do_inspectVariables(self, msg, _args, _state):
        if self.stopped_threads:
            # debugpy holds every thread of the stopped rank: the panel gets the stopped
            # frame's variables through stackTrace/scopes/variables instead.
            return response(msg, body={"variables": []})
        try:
            variables = self.inspector.variables.call_one(None).get(timeout=INSPECT_TIMEOUT_S)
        except TimeoutError:
            variables = []  # the rank is too busy to look (a long C call holds its GIL)
        return response(msg, body={"variables": variables})

    def _do_variables(self, msg, args, _state):
        if not self.stopped_threads:
            ref = args.get("variablesReference")
            variables = self.inspector.variables.call_one(ref).get(timeout=INSPECT_TIMEOUT_S)
            return response(msg, body={"variables": variables})
        reply = self._forward(msg)
        if reply.get("success"):
            reply["body"]["variables"] = [v for v in reply["body"]["variables"] if rank_debug.visible(v["name"])]
        return reply

    def _do_richInspectVariables(self, msg, args, _state):
        name = args.get("variableName", "")
        if not name.isidentifier():
            return response(msg, name in ("special variables", "function variables"),
                            body={"data": {}, "metadata": {}})
        if not self.stopped_threads:
            data, md = self.inspector.rich.call_one(name).get(timeout=INSPECT_TIMEOUT_S)
            return response(msg, body={"data": data, "metadata": md})
        # 'clipboard' asks debugpy for the full repr of the (data, metadata) pair.
        expr = f"__import__('monarch_kernel.kernel.rank_debug', fromlist=['rich']).rich({name})"
        reply = self._request("evaluate", {"expression": expr, "frameId": args.get("frameId"), "context": "clipboard"})
        if not reply.get("success"):
            return response(msg, False, message=reply.get("message", "cannot evaluate on the rank"))
        data, md = ast.literal_eval(reply["body"]["result"])
        return response(msg, body={"data": data, "metadata": md})

    def _do_copyToGlobals(self, msg, args, _state):
        dst, src = args.get("dstVariableName", ""), args.get("srcVariableName", "")
        if not (dst.isidentifier() and src.isidentifier()):
            return response(msg, False, message="dstVariableName and srcVariableName must be identifiers")
        return self._request("setExpression", {"expression": f"globals()['{dst}']", "value": src,
                                               "frameId": args.get("srcFrameId")})


class MeshDebugger(Debugger):
    """ipykernel's debugger for the kernel itself, or a relay to the rank chosen by
    ``%mesh debug R`` (``target``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import debugpy

        # Rank processes start from the kernel: debugpy must not hook into their launch
        # (they would wait for a debugger); ranks get their own debugpy on demand.
        debugpy.configure(subProcess=False)
        self.target: RankTarget | None = None
        self.frontend = FrontendState()
        # One worker keeps the frontend's requests in order while they block on a rank.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mesh-debug")
        self.control_loop: asyncio.AbstractEventLoop | None = None

    async def process_request(self, message):
        self.control_loop = asyncio.get_running_loop()
        target = self.target
        if target is None:
            reply = await super().process_request(message)
        else:
            reply = await self.control_loop.run_in_executor(self._executor, target.handle, message, self.frontend)
        self.frontend.record(message)
        return reply

    def _stopped_where(self) -> str:
        if self.target is not None and self.target.stopped_threads:
            return self.target.label
        if self.target is None and self.stopped_threads:
            return "the kernel"
        return ""

    def switch(self, target: RankTarget | None) -> None:
        """Point the frontend's session at ``target`` (None: the kernel itself).

        Called from the shell thread (``%mesh debug``); blocks until the new target has
        the frontend's breakpoints.
        """
        where = self._stopped_where()
        if where:
            raise UsageError(f"{where} is stopped in the debugger: continue it (or turn the debugger off) "
                             f"before switching with %mesh debug")
        old, started = self.target, self.frontend.attached
        if old is not None:
            old.current = False
            old.disconnect()
        elif started and self.is_started:
            self._in_control_loop(self._kernel_request("disconnect", {"restart": False, "terminateDebuggee": False}))
        self.target = target
        if not started:
            return
        if target is None and not self.debugpy_initialized:
            self._listen_here()
        if target is not None:
            target.connect(self.frontend.initialize)
            target.attach(self.frontend.attach, self.frontend)
        else:
            self._in_control_loop(self._restart_kernel_session())

    def _listen_here(self) -> None:
        """Start the kernel's own debugpy on this (the shell's) thread, as ipykernel's
        ``start()`` would through an execute request, which cannot run while this cell does."""
        import debugpy

        host, port = self.debugpy_client.get_host_port()
        debugpy.listen((host, int(port)))
        self.debugpy_initialized = True

    async def _kernel_request(self, command: str, arguments: dict | None = None) -> dict:
        msg = {"type": "request", "seq": 0, "command": command}
        if arguments is not None:
            msg["arguments"] = arguments
        return await super().process_request(msg)

    async def _restart_kernel_session(self) -> None:
        """Give the kernel's own debugpy the frontend's session back."""
        state = self.frontend
        await self._kernel_request("initialize", state.initialize or {})
        await self._kernel_request("attach", dict(state.attach or {}))
        for args in state.breakpoints.values():
            await self._kernel_request("setBreakpoints", args)
        if state.exceptions is not None:
            await self._kernel_request("setExceptionBreakpoints", state.exceptions)

    def _in_control_loop(self, coro) -> None:
        loop = self.control_loop
        if loop is None:  # the frontend never sent a request: nothing runs there yet
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, loop).result(REPLY_TIMEOUT_S)


def command(session, shell, args: list[str]) -> None:
    """``%mesh debug R [--listen [--host H]]`` and ``%mesh debug off``."""
    usage = ("type  %mesh debug R  (JupyterLab's debugger on rank R),  %mesh debug R --listen [--host H]  "
             "(an attach config for VS Code or any DAP client), or  %mesh debug off")
    if args == ["off"]:
        dbg = _kernel_debugger(shell)
        dbg.switch(None)
        print("JupyterLab's debugger now debugs the kernel itself")
        return
    if not args:
        dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
        target = getattr(dbg, "target", None)
        print(f"JupyterLab's debugger is on {target.label}" if target is not None
              else "JupyterLab's debugger is on the kernel itself;  %mesh debug R  moves it to rank R")
        return
    rank_word, flags = args[0], args[1:]
    listen, host = False, None
    it = iter(flags)
    for a in it:
        if a == "--listen":
            listen = True
        elif a == "--host":
            host = next(it, None)
            if not host:
                raise UsageError("--host needs an address, e.g.  %mesh debug 3 --listen --host 0.0.0.0")
        else:
            raise UsageError(f"%mesh debug: unexpected {a!r}; {usage}")
    if host is not None and not listen:
        raise UsageError("--host goes with --listen:  %mesh debug 3 --listen --host 0.0.0.0")
    try:
        rank = int(rank_word)
    except ValueError:
        raise UsageError(usage) from None
    procs, consoles = session.get()
    if not 0 <= rank < len(procs):
        raise UsageError(f"%mesh debug {rank}: the mesh has ranks 0-{len(procs) - 1}")
    one = consoles.slice(ranks=rank)
    want = host or "127.0.0.1"
    key = (procs._ref.id, rank)
    known = _inspectors.get(key)
    if known is None:
        # Spawned before debugpy starts on the rank: an actor thread started after it
        # makes an interrupt of a rank stopped at a breakpoint land a line late.
        inspector = procs.slice(ranks=rank).spawn(f"inspector-{uuid.uuid4().hex[:8]}", rank_debug.Inspector)
    got_host, port = one.debug_listen.call_one(want).get(timeout=REPLY_TIMEOUT_S)
    if known is not None:
        inspector, known_port = known
        if known_port != port:  # the rank was restarted: its inspector went with it
            inspector = procs.slice(ranks=rank).spawn(f"inspector-{uuid.uuid4().hex[:8]}", rank_debug.Inspector)
    _inspectors[key] = (inspector, port)
    if listen:
        if got_host != want:
            print(f"note: rank {rank}'s debugpy already listens on {got_host}; a rank starts debugpy once, "
                  f"so --host applies only the first time (restart the rank to change it)")
        print(launch_config(procs.name, rank, got_host, port))
        return
    dbg = _kernel_debugger(shell)
    current = dbg.target
    if current is not None and (current.mesh, current.rank) == (procs.name, rank) and current.conn is not None:
        print(f"JupyterLab's debugger is already on {current.label}")
        return
    dbg.switch(RankTarget(inspector, procs.name, rank, (got_host, port), dbg.event_callback))
    print(f"JupyterLab's debugger now debugs rank {rank} (its debugpy listens on {got_host}:{port}): "
          f"set breakpoints in %%mesh cells and run them.  %mesh debug off goes back to the kernel.")


def forget_mesh(shell, mesh: str) -> None:
    """Before a mesh stops: if the debugger is on one of its ranks, give it back to the kernel."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if isinstance(target, RankTarget) and target.mesh == mesh:
        target.stopped_threads.clear()  # the rank is about to end; nothing to resume
        dbg.switch(None)
        print(f"JupyterLab's debugger was on {target.label}; it now debugs the kernel itself")


def stopped_rank(shell, mesh: str, ranks) -> int | None:
    """The rank among ``ranks`` that JupyterLab's debugger holds stopped, if any."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if isinstance(target, RankTarget) and target.mesh == mesh and target.rank in ranks and target.stopped_threads:
        return target.rank
    return None


def release_for_interrupt(shell, mesh: str, ranks, console_id: str = "") -> None:
    """Resume a rank stopped in JupyterLab's debugger so the interrupt sent to it lands:
    a thread suspended by debugpy takes a pending KeyboardInterrupt only once it runs.
    ``console_id``: interrupt that actor first, through the rank's inspector."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if not isinstance(target, RankTarget) or target.mesh != mesh or target.rank not in ranks:
        return
    if console_id and target.stopped_threads:
        try:
            target.inspector.interrupt.call_one(console_id).get(timeout=INSPECT_TIMEOUT_S)
        except (TimeoutError, ActorError):
            pass  # the rank is gone or stuck: resuming it below is all that is left
    for thread in list(target.stopped_threads):
        try:
            target._request("continue", {"threadId": thread})
        except (ConnectionError, concurrent.futures.TimeoutError):
            pass


def launch_config(mesh: str, rank: int, host: str, port: int) -> str:
    """A VS Code ``launch.json`` "attach" entry for a rank's debugpy."""
    import json

    entry = {"name": f"monarch {mesh} rank {rank}", "type": "debugpy", "request": "attach",
             "connect": {"host": host, "port": port}, "justMyCode": False}
    return ("Add this to .vscode/launch.json \"configurations\" (one DAP client at a time per rank):\n"
            + json.dumps(entry, indent=2))


def _kernel_debugger(shell) -> MeshDebugger:
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    if not isinstance(dbg, MeshDebugger):
        raise UsageError("JupyterLab's debugger on a rank needs the 'Python 3 (monarch mesh)' kernel; "
                         "here, use  %mesh debug R --listen  and attach VS Code (or any DAP client)")
    return dbg
