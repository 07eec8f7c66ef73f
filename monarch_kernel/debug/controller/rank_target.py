"""One rank's debugpy, driven for JupyterLab: ``RankTarget`` answers the frontend's DAP
requests for the rank chosen with ``%mesh debug R`` (forwarding what debugpy knows through
the rank's relay, and the Jupyter extras through the rank's ``Inspector``), and
``FrontendState`` remembers what the frontend set up so a new target can be given the same.

Runs in the kernel, off its control loop (requests block on the rank).  It must never leave
a rank suspended when it lets go of it, and never step into the runtime's own frames.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import threading
from dataclasses import dataclass, field

from ipykernel.compiler import get_file_name, get_tmp_directory, get_tmp_hash_seed

from ...runtime import config
from ..dap import DapClient
from ..messages import DapEvent, DapResponse
from ..rank import rank_debugpy
from ..rank.inspector import visible
from .tunnel import TunnelConnection

REPLY_TIMEOUT_S = config.seconds("dap_reply_timeout")
INITIALIZE_TIMEOUT_S = config.seconds("dap_initialize_timeout")
INSPECT_TIMEOUT_S = config.seconds("dap_inspect_timeout")


def response(request: dict, success: bool = True, body: dict | None = None, message: str = "") -> dict:
    """The DAP response to ``request`` (a frontend's request, as ipykernel hands it over)."""
    seq = request.get("seq", 0)
    return DapResponse(seq, request.get("command", ""), success, body, message, seq=seq).encode()


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

    def __init__(self, inspector, mesh: str, rank: int, publish, relay=None, remote: bool = False):
        self.inspector = inspector  # this rank's Inspector actor: answers while the console is busy
        self.relay = relay  # this rank's DapRelay actor: the DAP session goes through it
        self.mesh, self.rank = mesh, rank
        self.remote = remote  # the rank runs on another host: its files are not ours
        self._publish = publish
        self.current = True  # events reach the frontend only while this is the target
        self.conn: DapClient | None = None
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
        typed = DapEvent.decode(msg)
        event, body = typed.event, typed.body or {}
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

    def request(self, command: str, arguments: dict | None = None) -> dict:
        """Ask the rank's debugpy; its whole response (raises ConnectionError if not connected)."""
        conn = self.conn
        if conn is None:
            raise ConnectionError(f"not connected to {self.label}'s debugger")
        return conn.request(command, arguments).result(REPLY_TIMEOUT_S)

    def connect(self, initialize_args: dict | None) -> dict:
        with self._lock:
            if self.conn is None:
                if self.relay is None:
                    raise ConnectionError(f"{self.label} has no relay to its debugpy; type  %mesh debug {self.rank}")
                conn = self.conn = TunnelConnection(self.relay, self.label, self._on_event, self._on_close)
                self._initialized = concurrent.futures.Future()
                self.attached = False
                pending = conn.request("initialize", initialize_args or {
                    "clientID": "monarch-kernel", "adapterID": "python", "pathFormat": "path",
                    "linesStartAt1": True, "columnsStartAt1": True})
                try:
                    self.capabilities = pending.result(INITIALIZE_TIMEOUT_S)
                except concurrent.futures.TimeoutError:
                    conn.close()
                    self.conn = None
                    raise ConnectionError(
                        f"the debugpy of {self.label} took the connection but did not answer within "
                        f"{INITIALIZE_TIMEOUT_S:g} s; its adapter may have stopped taking new clients "
                        f"(debugpy 1.8 can, after a client leaves as another arrives).  Restart the "
                        f"rank's mesh to debug it again") from None
            return self.capabilities or {}

    def attach(self, args: dict | None, state: FrontendState) -> dict:
        """Attach, then give debugpy the frontend's breakpoints before configurationDone."""
        with self._lock:
            if self.attached:
                return {"success": True}
            args = dict(args or {})
            for key in ("connect", "listen", "host", "port", "processId", "subProcessId"):
                args.pop(key, None)  # the frontend's, for the kernel's debugpy: the rank's adapter has its own
            args.setdefault("justMyCode", False)
            # Never step into the runtime's own frames (worker loop, console plumbing).
            args["rules"] = [*args.get("rules", []), {"path": rank_debugpy.package_dir(), "include": False}]
            assert self.conn is not None  # connect() above made it
            pending = self.conn.request("attach", args)
            self._initialized.result(REPLY_TIMEOUT_S)
            for bp_args in state.breakpoints.values():
                self.set_breakpoints(bp_args)
            if state.exceptions is not None:
                self.request("setExceptionBreakpoints", state.exceptions)
            self.request("configurationDone")
            reply = pending.result(REPLY_TIMEOUT_S)
            self.attached = reply.get("success", False)
            return reply

    def set_breakpoints(self, args: dict) -> dict:
        reply = self.request("setBreakpoints", args)
        if reply.get("success"):
            self.breakpoints[args["source"]["path"]] = [
                {"line": bp["line"]} for bp in reply.get("body", {}).get("breakpoints", []) if "line" in bp]
        return reply

    def disconnect(self) -> None:
        """Leave the rank running: debugpy resumes it and drops our breakpoints."""
        with self._lock:
            if self.conn is not None:
                try:
                    self.request("disconnect", {"restart": False, "terminateDebuggee": False})
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
        return self.request(msg["command"], msg.get("arguments"))

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
        rank_debugpy.write_source(path, code)
        if self.remote and not self.stopped_threads:
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
            reply["body"]["variables"] = [v for v in reply["body"]["variables"] if visible(v["name"])]
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
        expr = f"__import__('monarch_kernel.debug.rank.inspector', fromlist=['rich']).rich({name})"
        reply = self.request("evaluate", {"expression": expr, "frameId": args.get("frameId"), "context": "clipboard"})
        if not reply.get("success"):
            return response(msg, False, message=reply.get("message", "cannot evaluate on the rank"))
        data, md = ast.literal_eval(reply["body"]["result"])
        return response(msg, body={"data": data, "metadata": md})

    def _do_copyToGlobals(self, msg, args, _state):
        dst, src = args.get("dstVariableName", ""), args.get("srcVariableName", "")
        if not (dst.isidentifier() and src.isidentifier()):
            return response(msg, False, message="dstVariableName and srcVariableName must be identifiers")
        return self.request("setExpression", {"expression": f"globals()['{dst}']", "value": src,
                                               "frameId": args.get("srcFrameId")})
