"""JupyterLab's debugger panel, as a client of a real kernel: ``Session`` executes cells without
waiting, answers input requests (pdb over the stdin channel) and sends DAP requests on the
control channel; ``start_debugger`` is what the panel sends when it is switched on.  Shared by
the debugger's tests and those of jobs on other hosts."""

from __future__ import annotations

import itertools
import queue
import time

from support.kernels import iopub, text

_seq = itertools.count(1)


class Session:
    """Drives one kernel: executes cells without waiting, answers input requests and sends
    debug requests; every IOPub message it has seen is in ``io`` (the tests' one collector)."""

    def __init__(self, kc):
        self.kc = kc
        self.io = iopub(kc)
        self.prompts: list[str] = []

    def pump(self, wait: float = 0.05) -> None:
        self.io.pump(wait)

    def events(self, name: str) -> list[dict]:
        return self.io.events(name)

    def wait_event(self, name: str, count: int = 1, timeout: float = 30) -> dict:
        self.io.wait(f"a {name!r} debug event", lambda: len(self.events(name)) >= count, timeout)
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
        return text(self.io.outputs(msg_id))

    def finished(self, msg_id: str) -> bool:
        return self.io.idle(msg_id)

    def wait_done(self, msg_id: str, answers=(), timeout: float = 60) -> str:
        """Wait for the cell to finish, typing ``answers`` at its input prompts in turn."""
        answers = list(answers)

        def answer_one_prompt() -> None:
            try:
                req = self.kc.get_stdin_msg(timeout=0.05)
            except queue.Empty:
                return
            self.prompts.append(req["content"]["prompt"])
            assert answers, f"an unexpected prompt {req['content']['prompt']!r}; output:\n{self.output(msg_id)}"
            self.kc.input(answers.pop(0))

        self.io.wait_idle(msg_id, timeout, also=answer_one_prompt)
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
