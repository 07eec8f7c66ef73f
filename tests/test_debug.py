"""Debugging ranks through a real kernel, as JupyterLab would: the debugger panel's DAP
requests (debug_request on the control channel, debug_event on IOPub) routed to a rank's
real debugpy, and the distributed pdb carried over the stdin channel."""

from __future__ import annotations

import itertools
import json
import queue
import time

import pytest
from _kernels import ensure_kernelspec, kernel, run, text

pytestmark = pytest.mark.timeout(120)

_seq = itertools.count(1)


@pytest.fixture(scope="module")
def kernelspec():
    return ensure_kernelspec()


@pytest.fixture
def kc(kernelspec):
    with kernel(kernelspec) as client:
        yield client


class Session:
    """Drives one kernel: executes cells without waiting, answers input requests,
    sends debug requests, and keeps every IOPub message it has seen."""

    def __init__(self, kc):
        self.kc = kc
        self.iopub: list[dict] = []
        self.prompts: list[str] = []

    def pump(self, wait: float = 0.05) -> None:
        try:
            while True:
                self.iopub.append(self.kc.get_iopub_msg(timeout=wait))
                wait = 0.01
        except queue.Empty:
            pass

    def events(self, name: str) -> list[dict]:
        return [m["content"] for m in self.iopub
                if m["msg_type"] == "debug_event" and m["content"].get("event") == name]

    def wait_event(self, name: str, count: int = 1, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while len(self.events(name)) < count:
            assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for a {name!r} debug event"
            self.pump()
        return self.events(name)[count - 1]

    def dap(self, command: str, arguments: dict | None = None, timeout: float = 30) -> dict:
        content = {"type": "request", "seq": next(_seq), "command": command, "arguments": arguments or {}}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out after {timeout} s waiting for the reply to debug request {command!r}"
            reply = self.kc.get_control_msg(timeout=left)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def execute(self, code: str) -> str:
        return self.kc.execute(code, allow_stdin=True)

    def output(self, msg_id: str) -> str:
        out = []
        for m in self.iopub:
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            kind, c = m["msg_type"], m["content"]
            if kind == "stream":
                out.append(c["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(c["data"].get("text/plain", ""))
            elif kind == "error":
                out.append("\n".join(c["traceback"]))
        return "".join(out)

    def finished(self, msg_id: str) -> bool:
        return any(m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                   and m["content"]["execution_state"] == "idle" for m in self.iopub)

    def wait_done(self, msg_id: str, answers=(), timeout: float = 60) -> str:
        """Wait for the cell to finish, typing ``answers`` at its input prompts in turn."""
        answers = list(answers)
        deadline = time.monotonic() + timeout
        while not self.finished(msg_id):
            assert time.monotonic() < deadline, (f"timed out after {timeout} s waiting for the cell to finish; "
                                                 f"output so far:\n{self.output(msg_id)}")
            try:
                req = self.kc.get_stdin_msg(timeout=0.05)
            except queue.Empty:
                pass
            else:
                self.prompts.append(req["content"]["prompt"])
                assert answers, f"an unexpected prompt {req['content']['prompt']!r}; output:\n{self.output(msg_id)}"
                self.kc.input(answers.pop(0))
            self.pump(0.05)
        return self.output(msg_id)

    def wait_prompt(self, msg_id: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for an input prompt"
            try:
                req = self.kc.get_stdin_msg(timeout=0.05)
            except queue.Empty:
                self.pump(0.05)
                continue
            self.prompts.append(req["content"]["prompt"])
            return req["content"]["prompt"]

    def cell(self, code: str, answers=(), timeout: float = 60) -> str:
        return self.wait_done(self.execute(code), answers, timeout)


INITIALIZE = {"clientID": "jupyterlab", "clientName": "JupyterLab", "adapterID": "python", "pathFormat": "path",
              "linesStartAt1": True, "columnsStartAt1": True, "supportsVariableType": True,
              "supportsVariablePaging": True, "supportsRunInTerminalRequest": True, "locale": "en-us"}

CELL = """%%mesh --ranks 1
from monarch_kernel import current_rank
x = current_rank().rank * 10
y = x + 1
print('y is', y)
y"""


def start_debugger(s: Session) -> None:
    """What JupyterLab's panel sends when the debugger is switched on."""
    assert s.dap("initialize", INITIALIZE)["success"]
    assert s.dap("attach", {})["success"]
    info = s.dap("debugInfo")
    assert info["success"] and info["body"]["isStarted"]


def test_jupyterlab_debugger_stops_on_a_rank(kc):
    s = Session(kc)
    out = s.cell("procs = %mesh spawn -n 2\n%mesh debug 1")
    assert "now debugs rank 1" in out, out
    start_debugger(s)
    info = s.dap("debugInfo")["body"]
    path = s.dap("dumpCell", {"code": CELL})["body"]["sourcePath"]
    assert path.startswith(info["tmpFilePrefix"]) and path.endswith(info["tmpFileSuffix"])
    bp = s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 4}], "sourceModified": False})
    assert bp["success"] and bp["body"]["breakpoints"][0]["verified"], bp
    assert s.dap("configurationDone")["success"]

    msg_id = s.execute(CELL)
    stopped = s.wait_event("stopped")
    assert stopped["body"]["reason"] == "breakpoint"
    thread = stopped["body"]["threadId"]
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 4)
    assert s.dap("debugInfo")["body"]["stoppedThreads"] == [thread]
    scopes = s.dap("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    variables = s.dap("variables", {"variablesReference": scopes[0]["variablesReference"]})["body"]["variables"]
    values = {v["name"]: v["value"] for v in variables}
    assert values["x"] == "10" and "y" not in values  # rank 1's own namespace, before line 4
    assert s.dap("evaluate", {"expression": "x + 5", "frameId": frames[0]["id"], "context": "repl"})["body"]["result"] == "15"

    # Step over line 4, then look at y through the panel's rich inspector.
    assert s.dap("next", {"threadId": thread})["success"]
    s.wait_event("stopped", 2)
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert frames[0]["line"] == 5
    rich = s.dap("richInspectVariables", {"variableName": "y", "frameId": frames[0]["id"]})
    assert rich["success"] and rich["body"]["data"]["text/plain"] == "11", json.dumps(rich)
    assert s.dap("continue", {"threadId": thread})["success"]
    out = s.wait_done(msg_id)
    assert "[rank 1] y is 11" in out and "[rank 1] 11" in out, out

    # Not stopped: the variable panel shows rank 1's namespace, not the kernel's.
    names = {v["name"]: v["value"] for v in s.dap("inspectVariables")["body"]["variables"]}
    assert names.get("x") == "10" and names.get("y") == "11" and "procs" not in names
    assert s.dap("richInspectVariables", {"variableName": "x"})["body"]["data"]["text/plain"] == "10"
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]


def test_pdb_in_a_cell_talks_over_stdin(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    out = s.cell("%%mesh --ranks 1\nx = 41\nbreakpoint()\ny = x + 1\nprint('y is', y)\ny", ["p x", "n", "p y", "c"])
    assert "rank 1 stopped at cell line 4" in out, out
    assert "-> y = x + 1" in out and "41" in out and "-> print('y is', y)" in out and "42" in out
    assert s.prompts == ["(Pdb rank 1) "] * 4
    assert "[rank 1] y is 42" in out and "[rank 1] 42" in out
    # Post-mortem: an uncaught error stops the rank where it was raised.
    assert "post-mortem pdb on" in s.cell("%mesh pdb --post-mortem on")
    out = s.cell("%%mesh --ranks 0\ndef f(v):\n    w = v * 2\n    return 1 / (w - w)\nf(3)", ["p w", "p v", "up", "c"])
    assert "rank 0 stopped after ZeroDivisionError: division by zero at cell line 4 (post-mortem)" in out, out
    assert "6\n3\n" in out and "-> f(3)" in out, out
    assert "ZeroDivisionError" in out.split("(post-mortem)")[1]  # and the cell still fails with it
    s.cell("%mesh pdb --post-mortem off")
    out = s.cell("%%mesh --ranks 0\n1 / 0")
    assert "stopped" not in out and "ZeroDivisionError" in out


def test_several_stopped_ranks_list_cast_and_continue(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2")
    msg_id = s.execute("%%mesh\nfrom monarch_kernel import current_rank\nx = current_rank().rank * 10\n"
                       "breakpoint()\nprint('after', x)")
    assert s.wait_prompt(msg_id) == "(mesh pdb) "
    deadline = time.monotonic() + 30
    while not ("rank 0 stopped" in s.output(msg_id) or "ranks 0-1 stopped" in s.output(msg_id)) \
            or not ("rank 1 stopped" in s.output(msg_id) or "ranks 0-1 stopped" in s.output(msg_id)):
        assert time.monotonic() < deadline, s.output(msg_id)
        s.pump()
    s.kc.input("list")
    out = s.wait_done(msg_id, ["cast 0-1 p x + 1", "attach 1", "p x", "detach", "continue"])
    assert "rank 0 (procs): cell line 5 in <module>" in out and "rank 1 (procs): cell line 5" in out, out
    assert "[rank 0] 1\n" in out and "[rank 1] 11\n" in out
    assert s.prompts == ["(mesh pdb) "] * 3 + ["(Pdb rank 1) "] * 2 + ["(mesh pdb) "]
    assert "[rank 0] after 0" in out and "[rank 1] after 10" in out


def test_pdb_in_an_endpoint_of_a_notebook_class(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2\nfrom monarch_kernel import Actor, endpoint\n"
           "class Greeter(Actor):\n"
           "    @endpoint\n"
           "    def greet(self, name):\n"
           "        greeting = 'hi ' + name\n"
           "        breakpoint()\n"
           "        return greeting.upper()\n"
           "g = procs.spawn('greeters', Greeter)")
    out = s.cell("fut = g.slice(ranks=1).greet.call_one('bob')\nimport time; time.sleep(1)")
    assert "rank 1 stopped at" in out and "%mesh pdb attach 1" in out, out
    out = s.cell("%mesh pdb")
    assert "rank 1 (procs):" in out and "in greet" in out, out
    out = s.cell("%mesh pdb attach 1", ["l", "p greeting", "c"])
    assert "breakpoint()" in out and "return greeting.upper()" in out  # source from the notebook cell
    assert "'hi bob'" in out
    assert "'HI BOB'" in s.cell("fut.get(timeout=30)")
    assert "no rank is stopped in pdb" in s.cell("%mesh pdb")
