"""Debugging ranks through a real kernel, as JupyterLab would: the debugger panel's DAP
requests (debug_request on the control channel, debug_event on IOPub) routed to a rank's
real debugpy, and the distributed pdb carried over the stdin channel."""

from __future__ import annotations

import json
import time

import pytest
from support.dap import CELL, Session, start_debugger
from support.kernels import kernel, run, text

pytestmark = pytest.mark.timeout(120)


def test_pdb_messages_round_trip_through_the_wire_codec():
    from monarch_kernel.actor.port import Port
    from monarch_kernel.debug.messages import Ended, Prompt, Resumed, Stopped
    from monarch_kernel.runtime.wire.envelope import Part
    from monarch_kernel.runtime.wire.serialize import dumps

    messages = [Stopped("m", 3, 1, "/tmp/cell.py", 4, "<module>", "breakpoint", True, "", ("/x.py",),
                        Port("ipc:///tmp/a", 7, 3)),
                Prompt("m", 3, 1, "> here\n", 4, "/tmp/cell.py"), Resumed("m", 3, 1, "", True), Ended("m", 3, 1)]
    for msg in messages:
        back = Part(0, 0, dumps(msg)).load()
        assert type(back) is type(msg)
        if isinstance(msg, Stopped):
            assert (back.reply.address, back.reply.port_id) == ("ipc:///tmp/a", 7)
            back.reply = msg.reply
        assert back == msg


def test_dap_frames_split_across_reads():
    from monarch_kernel.debug.dap import FrameReader, encode

    wire = encode({"seq": 1, "type": "event", "event": "stopped"}) + encode({"seq": 2, "body": "é" * 3})
    reader = FrameReader()
    got = []
    for i in range(0, len(wire), 7):
        got.extend(reader.feed(wire[i:i + 7]))
    assert got == [{"seq": 1, "type": "event", "event": "stopped"}, {"seq": 2, "body": "ééé"}]


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
    evaluated = s.dap("evaluate", {"expression": "x + 5", "frameId": frames[0]["id"], "context": "repl"})
    assert evaluated["body"]["result"] == "15"

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
    # Stopping the mesh gives the panel back to the kernel, still attached.
    assert "it now debugs the kernel itself" in s.cell("%mesh stop")
    assert "on the kernel itself" in s.cell("%mesh debug")
    assert s.dap("debugInfo")["body"]["isStarted"]
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
    msg_id = s.execute("fut = g.slice(ranks=1).greet.call_one('bob')")
    s.io.wait_output(msg_id, "rank 1 stopped at")
    out = s.output(msg_id)
    assert "rank 1 stopped at Cell In[1], line 8" in out and "%mesh pdb attach 1" in out, out  # as IPython names it
    out = s.cell("%mesh pdb")
    assert "rank 1 (procs):" in out and "in greet" in out, out
    out = s.cell("%mesh pdb attach 1", ["l", "p greeting", "where", "c"])
    assert "breakpoint()" in out and "return greeting.upper()" in out  # source from the notebook cell
    assert "> Cell In[1], line 8, in greet()" in out and "ipykernel_" not in out, out
    assert "'hi bob'" in out
    assert "'HI BOB'" in s.cell("fut.get(timeout=30)")
    assert "no rank is stopped in pdb" in s.cell("%mesh pdb")


def test_a_plain_cell_waiting_on_an_actor_serves_its_breakpoint(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2\nfrom monarch_kernel import Actor, endpoint\n"
           "class Stepper(Actor):\n"
           "    @endpoint\n"
           "    def step(self, k):\n"
           "        loss = k * 0.5\n"
           "        breakpoint()\n"
           "        return loss + 1\n"
           "steppers = procs.spawn('steppers', Stepper)")
    # The cell blocks in .get(); the rank's pdb prompt comes to this cell, not a hint.
    out = s.cell("steppers.slice(ranks=1).step.call_one(4).get(timeout=60)", ["p loss", "n", "c"])
    assert "rank 1 stopped at" in out and "%mesh pdb attach" not in out, out
    assert "2.0" in out and "3.0" in out, out
    assert any("Pdb rank 1" in p for p in s.prompts), s.prompts


def test_breakpoint_on_a_mesh_spawned_with_the_api_in_a_cell(kc):
    s = Session(kc)
    s.cell("from monarch_kernel import Actor, endpoint, this_host\n"
           "class Probe(Actor):\n"
           "    @endpoint\n"
           "    def look(self, k):\n"
           "        seen = k * 11\n"
           "        breakpoint()\n"
           "        return seen\n"
           "api_procs = this_host().spawn_procs(per_host={'gpus': 2})\n"
           "probes = api_procs.spawn('probes', Probe)")
    out = s.cell("probes.slice(gpus=0).look.call_one(3).get(timeout=60)", ["p seen", "c"])
    assert "rank 0 stopped at" in out and "33" in out, out
    s.cell("api_procs.stop().get(timeout=30)")


def test_post_mortem_in_an_actor_endpoint(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2\nfrom monarch_kernel import Actor, endpoint\n"
           "class Divider(Actor):\n"
           "    @endpoint\n"
           "    def divide(self, a, b):\n"
           "        ratio = a / b\n"
           "        return ratio\n"
           "divs = procs.spawn('divs', Divider)\n"
           "%mesh pdb --post-mortem on")
    out = s.cell("divs.slice(ranks=0).divide.call_one(7, 0).get(timeout=60)", ["p a, b", "c"])
    assert "rank 0 stopped after ZeroDivisionError" in out and "post-mortem" in out, out
    assert "(7, 0)" in out and "ZeroDivisionError" in out, out
    s.cell("%mesh pdb --post-mortem off")
    out = s.cell("divs.slice(ranks=0).divide.call_one(1, 0).get(timeout=60)")
    assert "ZeroDivisionError" in out and "stopped" not in out, out


def _stop_at_breakpoint(s: Session, cell: str, line: int) -> tuple[str, int]:
    """Set a breakpoint on ``line`` of ``cell`` as the panel does, run it, wait for the stop."""
    path = s.dap("dumpCell", {"code": cell})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": line}]})["success"]
    assert s.dap("configurationDone")["success"]
    count = len(s.events("stopped"))
    msg_id = s.execute(cell)
    s.wait_event("stopped", count + 1)
    return msg_id, s.events("stopped")[-1]["body"]["threadId"]


def test_disconnect_while_stopped_leaves_the_rank_running(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 2\n%mesh debug 0")
    start_debugger(s)
    msg_id, _thread = _stop_at_breakpoint(s, "%%mesh --ranks 0\na = 1\nb = a + 1\nprint('b', b)", 3)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    assert "[rank 0] b 2" in s.wait_done(msg_id, timeout=30)
    # Interrupt while stopped: the stop button still ends the cell and keeps the namespace.
    start_debugger(s)
    msg_id, _thread = _stop_at_breakpoint(s, "%%mesh --ranks 0\nc = 3\nd = c + 1", 3)
    start = time.monotonic()
    kc.parent.interrupt_kernel()
    assert "interrupted on rank 0; its namespace is kept" in s.wait_done(msg_id, timeout=30)
    assert time.monotonic() - start < 8, "the interrupt waited out its grace period"
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    assert "[rank 0] (2, 3, False)" in s.cell("%%mesh --ranks 0\nb, c, 'd' in globals()")


def test_switching_ranks_with_the_debugger_on(kc):
    s = Session(kc)
    start_debugger(s)  # the panel is on before any mesh: it debugs the kernel itself
    actor_cell = ("from monarch_kernel import Actor, endpoint\n"
                  "class Worker(Actor):\n"
                  "    @endpoint\n"
                  "    def work(self, v):\n"
                  "        w = v * 3\n"
                  "        return w + 1")
    path = s.dap("dumpCell", {"code": actor_cell})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 6}]})["success"]
    assert s.dap("configurationDone")["success"]
    assert "now debugs rank 1" in s.cell("procs = %mesh spawn -n 2\n%mesh debug 1")
    s.cell(actor_cell)
    s.cell("workers = procs.spawn('workers', Worker)\nfut = workers.slice(ranks=1).work.call_one(5)")
    stopped = s.wait_event("stopped")  # the breakpoint set before the switch, in a notebook class
    frames = s.dap("stackTrace", {"threadId": stopped["body"]["threadId"]})["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"], frames[0]["name"]) == (path, 6, "work")
    out = s.cell("%mesh debug 0")
    assert "rank 1 of mesh 'procs' is stopped in the debugger: continue it" in out, out
    assert s.dap("continue", {"threadId": stopped["body"]["threadId"]})["success"]
    assert "16" in s.cell("fut.get(timeout=30)")
    assert "debugs the kernel itself" in s.cell("%mesh debug off")
    # Back on the kernel: its own cells stop again.
    msg_id, thread = _stop_at_breakpoint(s, "k = 7\nk2 = k * 2\nprint(k2)", 2)
    frames = s.dap("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert frames[0]["line"] == 2
    assert s.dap("continue", {"threadId": thread})["success"]
    assert "14" in s.wait_done(msg_id)
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]


def test_breakpoints_reach_actors_spawned_before_the_debugger(kc):
    s = Session(kc)
    actor_cell = ("from monarch_kernel import Actor, endpoint\n"
                  "class Early(Actor):\n"
                  "    @endpoint\n"
                  "    def work(self, v):\n"
                  "        w = v + 100\n"
                  "        return w\n"
                  "    @endpoint\n"
                  "    async def awork(self, v):\n"
                  "        u = v + 200\n"
                  "        return u")
    s.cell("procs = %mesh spawn -n 2\n" + actor_cell)
    s.cell("early = procs.spawn('early', Early)\nearly.work.call(1).get(timeout=30)")  # worker threads exist now
    assert "now debugs rank 0" in s.cell("%mesh debug 0")
    start_debugger(s)
    path = s.dap("dumpCell", {"code": "procs = %mesh spawn -n 2\n" + actor_cell})["body"]["sourcePath"]
    assert s.dap("setBreakpoints", {"source": {"path": path},
                                    "breakpoints": [{"line": 7}, {"line": 11}]})["success"]
    assert s.dap("configurationDone")["success"]
    for call, line, value in (("work", 7, "105"), ("awork", 11, "205")):
        count = len(s.events("stopped"))
        s.cell(f"fut = early.slice(ranks=0).{call}.call_one(5)")
        stopped = s.wait_event("stopped", count + 1)
        frames = s.dap("stackTrace", {"threadId": stopped["body"]["threadId"]})["body"]["stackFrames"]
        assert (frames[0]["line"], frames[0]["name"]) == (line, call)
        assert s.dap("continue", {"threadId": stopped["body"]["threadId"]})["success"]
        assert value in s.cell("fut.get(timeout=30)")
    assert s.dap("disconnect", {"restart": False, "terminateDebuggee": False})["success"]


def test_listen_prints_a_vscode_attach_config_on_loopback(kc):
    import psutil

    from monarch_kernel.debug.dap import DapConnection

    s = Session(kc)
    out = s.cell("procs = %mesh spawn -n 2\n%mesh debug 1 --listen")
    entry = json.loads(out[out.index("{"):])
    assert entry["request"] == "attach" and entry["type"] == "debugpy"
    host, port = entry["connect"]["host"], entry["connect"]["port"]
    assert host == "127.0.0.1"
    kernel_pid = int(s.cell("import os\nos.getpid()").split()[-1])
    conns = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    listeners = [c.laddr for c in conns]
    assert listeners and all(a.ip == "127.0.0.1" for a in listeners), listeners
    # The port is the kernel's, which relays a proven client's session to rank 1's debugpy.
    assert {c.pid for c in conns} == {kernel_pid}, (conns, kernel_pid)
    # Any DAP client can attach with it, as VS Code would (the entry's fields in attach).
    inited = []
    conn = DapConnection(host, port, lambda m: inited.append(m["event"]))
    try:
        assert conn.request("initialize", {"adapterID": "python"}).result(30)["success"]
        pending = conn.request("attach", {"connect": entry["connect"], "justMyCode": False,
                                          "monarchSessionSecret": entry["monarchSessionSecret"]})
        deadline = time.monotonic() + 30
        while "initialized" not in inited:
            assert time.monotonic() < deadline, "timed out after 30 s waiting for debugpy's initialized event"
            time.sleep(0.05)
        assert conn.request("configurationDone").result(30)["success"]
        assert pending.result(30)["success"]
        # debugpy may send its process event after the attach response: wait for it.
        deadline = time.monotonic() + 30
        while "process" not in inited:
            assert time.monotonic() < deadline, f"no process event from debugpy within 30 s: {inited}"
            time.sleep(0.05)
        conn.request("disconnect", {"terminateDebuggee": False}).result(30)
    finally:
        conn.close()


@pytest.mark.parametrize("line, hint", [
    ("%mesh debug x", "%mesh debug R"),
    ("%mesh debug 5", "the mesh has ranks 0-1"),
    ("%mesh debug 0 --host 0.0.0.0", "--host goes with --listen"),
    ("%mesh pdb attach 0", "rank 0 is not stopped in pdb"),
    ("%mesh pdb --post-mortem maybe", "%mesh pdb --post-mortem on"),
    ("%mesh pdb frob", "%mesh pdb [list | attach R"),
])
def test_bad_debug_arguments_say_what_to_type(kc, line, hint):
    run(kc, "procs = %mesh spawn -n 2")
    out, reply = run(kc, line)
    assert reply["status"] == "error" and reply["ename"] == "UsageError", text(out)
    assert hint in reply["evalue"]


def test_interrupt_while_a_rank_waits_in_pdb(kc):
    s = Session(kc)
    s.cell("procs = %mesh spawn -n 1")
    msg_id = s.execute("%%mesh\nkept = 'yes'\nbreakpoint()\nkept = 'no'")
    assert s.wait_prompt(msg_id) == "(Pdb rank 0) "
    kc.parent.interrupt_kernel()
    out = s.wait_done(msg_id, timeout=30)
    assert "KeyboardInterrupt" in out, out
    assert "[rank 0] 'yes'" in s.cell("%%mesh\nkept")


def test_a_rank_left_in_pdb_by_a_gone_kernel_runs_on(kernelspec, tmp_path):
    """A detached mesh outlives its kernel: a rank it left stopped must not stay hung."""
    done = tmp_path / "done"
    name = "pdbleft"
    with kernel(kernelspec) as client:
        s = Session(client)
        s.cell(f"procs = %mesh spawn -n 1 --detach {name}\nfrom monarch_kernel import Actor, endpoint\n"
               "class Stopper(Actor):\n"
               "    @endpoint\n"
               "    def halt_here(self, path):\n"
               "        breakpoint()\n"
               "        open(path, 'w').write('ran on')\n"
               "stoppers = procs.spawn('stoppers', Stopper)")
        msg_id = s.execute(f"fut = stoppers.halt_here.call_one({str(done)!r})")
        s.io.wait_output(msg_id, "rank 0 stopped at")
    assert not done.exists()
    with kernel(kernelspec) as client:
        try:
            out, reply = run(client, f"procs = %mesh attach {name}")
            assert reply["status"] == "ok", text(out)
            deadline = time.monotonic() + 30
            while not done.exists():
                assert time.monotonic() < deadline, "timed out after 30 s waiting for the rank left in pdb to run on"
                time.sleep(0.1)
        finally:
            run(client, f"%mesh stop {name}")
