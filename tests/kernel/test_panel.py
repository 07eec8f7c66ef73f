"""The Mesh panel's comm, through a real monarch kernel driven by jupyter_client as
JupyterLab drives it: the panel opens ``monarch_kernel.panel`` (on a subshell, so its
buttons work while a cell runs), gets a state whenever something changes and nothing while
the kernel is idle, and its requests interrupt, restart, spawn and read the log.  A mesh over
32 ranks comes summarised (counts, and the ranks not idle), its full table on request.  Rich
output from several ranks becomes one grid bundle only while a panel is connected."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from support.freeze import freeze
from support.kernels import iopub, run, said_by, text

from monarch_kernel.kernel.panel.buttons import spawn_line
from monarch_kernel.kernel.panel.grid import GRID_MIME, grid_bundle
from monarch_kernel.kernel.panel.messages import (
    COMM_TARGET,
    JobRow,
    LogLines,
    MeshRow,
    MessageError,
    Metrics,
    PanelState,
    RankRow,
    Reply,
    Request,
)
from monarch_kernel.kernel.panel.view import RankLog
from monarch_kernel.kernel.quiet_status import QuietRequests

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------- messages (pure)


def test_every_panel_message_round_trips():
    row = RankRow(2, "vm", 123, "dead", "exit code 3", None, None, "bye")
    big = MeshRow("big", 1024, ["vm"], "local", rows=[row], dead=1, counts={"idle": 1023, "dead": 1}, summary=True)
    state = PanelState([MeshRow("procs", 4, ["vm"], "local", rows=[row], dead=1, current=True, tensors=2,
                                tensor_bytes=268), big],
                       [JobRow("ssh0", "ssh", True, ["h1", "h2"], ["procs"])], running=False, kernel_id="k")
    assert PanelState.decode(state.encode()) == state
    logs = LogLines("procs", [[1, 0, "stdout", "hi"]], 0)
    assert LogLines.decode(logs.encode()) == logs
    assert Reply.decode(Reply(3, False, "no").encode()) == Reply(3, False, "no")
    req = Request("spawn", id=4, n=2, name="side", detach=True)
    assert Request.decode(req.encode()) == req
    table = Request("table", id=5, mesh="big", full=False)
    assert Request.decode(table.encode()) == table
    series = Metrics("procs", {"0": {"cpu": [None, 12.5], "rss_mib": [80.1, 80.2]}})
    assert Metrics.decode(series.encode()) == series
    stacks = Reply(6, True, "stacks of procs: 1 group", "Stacks of mesh 'procs': 4 ranks in 1 group")
    assert Reply.decode(stacks.encode()) == stacks


@pytest.mark.parametrize("bad, why", [
    ([], "a Request is a JSON object"),
    ({"action": "explode"}, "unknown panel action 'explode'"),
    ({"action": "restart", "rank": "2"}, "rank is a number"),
    ({"action": "stop", "colour": "red"}, "Request has no field(s) colour"),
    ({"action": "table", "mesh": "big", "full": "yes"}, "full is true or false"),
])
def test_malformed_requests_are_refused_with_the_reason(bad, why):
    with pytest.raises(MessageError, match=why.replace("(", r"\(").replace(")", r"\)")):
        Request.decode(bad)


def test_the_new_mesh_dialog_becomes_one_spawn_line():
    assert spawn_line(Request("spawn", n=4)) == "spawn -n 4"
    assert spawn_line(Request("spawn", n=2, name="side", detach=True)) == "spawn -n 2 --detach side"
    assert (spawn_line(Request("spawn", n=2, launcher="ssh", hosts="h1,h2", ssh_args="-i key"))
            == "spawn -n 2 --job ssh --hosts h1,h2 --ssh-args '-i key'")
    assert (spawn_line(Request("spawn", n=1, launcher="slurm", nodes=2, partition="gpu"))
            == "spawn -n 1 --job slurm --nodes 2 --partition gpu")
    assert spawn_line(Request("spawn", n=1, launcher="ssh0")) == "spawn -n 1 --job ssh0"


def test_the_rank_log_keeps_each_ranks_recent_lines_in_arrival_order():
    log = RankLog(per_rank=2)
    for i in range(3):
        log.add("m", 0, "stdout", f"a{i}")
        log.add("m", 1, "stderr", f"b{i}")
    assert [e[3] for e in log.lines("m")] == ["a1", "b1", "a2", "b2"]
    assert [e[3] for e in log.lines("m", since=log.lines("m")[1][0])] == ["a2", "b2"]
    assert log.newest["m"] == 6


def test_the_panels_comm_messages_publish_no_status_and_the_rest_keep_their_pair():
    comms = {"c1": COMM_TARGET, "w1": "jupyter.widget"}
    quiet = QuietRequests((COMM_TARGET,), comms.get)

    def said(msg_id: str, kind: str, content: dict, between=lambda: None) -> list[bool]:
        parent = {"header": {"msg_id": msg_id, "msg_type": kind}, "content": content}
        busy = quiet.publishes("busy", parent)
        between()  # what the handler does meanwhile
        return [busy, quiet.publishes("idle", parent)]

    assert said("1", "comm_open", {"comm_id": "c2", "target_name": COMM_TARGET}) == [False, False]
    assert said("2", "comm_msg", {"comm_id": "c1", "data": {}}) == [False, False]
    # A comm_close removes its comm before the idle: the decision made at busy holds.
    assert said("3", "comm_close", {"comm_id": "c1"}, between=lambda: comms.pop("c1")) == [False, False]
    assert said("4", "comm_msg", {"comm_id": "w1", "data": {}}) == [True, True]  # another comm's
    assert said("5", "comm_msg", {"comm_id": "gone", "data": {}}) == [True, True]
    assert said("6", "execute_request", {"code": "1"}) == [True, True]
    assert quiet.publishes("starting", None)


def test_the_grid_bundle_keeps_a_text_view_of_every_rank():
    bundle = grid_bundle([(0, {"text/plain": "<Figure 0>", "image/png": "AA"}, {}), (1, {"text/plain": "x"}, {})])
    assert bundle["text/plain"] == "[rank 0] <Figure 0>\n[rank 1] x"
    assert [i["rank"] for i in bundle[GRID_MIME]["items"]] == [0, 1]


# ---------------------------------------------------------------- through a real kernel


class Panel:
    """The panel's end of the comm, as JupyterLab's is: opened on a subshell of its own."""

    def __init__(self, kc):
        self.kc, self.io = kc, iopub(kc)
        self.comm_id = uuid.uuid4().hex
        self.subshell = self._control("create_subshell_request", {})["subshell_id"]
        self._next = 0
        self.msg_ids: list[str] = []  # of every shell message this panel sent
        self.send_shell("comm_open", {"comm_id": self.comm_id, "target_name": COMM_TARGET, "data": {"action": "hello"}})

    def _control(self, msg_type: str, content: dict) -> dict:
        msg = self.kc.session.msg(msg_type, content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = self.kc.get_control_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]
        raise AssertionError(f"timed out after 30 s waiting for the {msg_type} reply")

    def send_shell(self, msg_type: str, content: dict) -> str:
        msg = self.kc.session.msg(msg_type, content)
        msg["header"]["subshell_id"] = self.subshell
        self.kc.shell_channel.send(msg)
        self.msg_ids.append(msg["header"]["msg_id"])
        return msg["header"]["msg_id"]

    def messages(self) -> list[dict]:
        return [m.content["data"] for m in self.io.messages
                if m.msg_type == "comm_msg" and m.content["comm_id"] == self.comm_id]

    def wait_quiet(self, quiet: float = 1.0, timeout: float = 30) -> int:
        """Wait until no panel message has come for ``quiet`` s; returns how many there are."""
        deadline = time.monotonic() + timeout
        n, since = len(self.messages()), time.monotonic()
        while time.monotonic() - since < quiet:
            assert time.monotonic() < deadline, f"the panel never went quiet for {quiet:g} s"
            self.io.pump(0.1)
            if len(self.messages()) != n:
                n, since = len(self.messages()), time.monotonic()
        return n

    def states(self) -> list[PanelState]:
        return [PanelState.decode(d) for d in self.messages() if d.get("type") == "state"]

    def wait_state(self, what: str, predicate, timeout: float = 10, after: int = 0) -> PanelState:
        """The newest state that ``predicate`` holds for (of those after the first ``after``)."""
        return self.io.wait(what, lambda: next((s for s in reversed(self.states()[after:]) if predicate(s)), None),
                            timeout,
                            detail=lambda: f"last state: {self.states()[-1:] or 'none'}")

    def send(self, action: str, **args) -> int:
        self._next += 1
        self.send_shell("comm_msg", {"comm_id": self.comm_id, "data": Request(action, id=self._next, **args).encode()})
        return self._next

    def request(self, action: str, timeout: float = 60, **args) -> Reply:
        rid = self.send(action, **args)
        data = self.io.wait(f"the reply to {action}", lambda: next(
            (d for d in self.messages() if d.get("type") == "reply" and d["id"] == rid), None), timeout)
        return Reply.decode(data)

    def close(self) -> None:
        self.send_shell("comm_close", {"comm_id": self.comm_id, "data": {}})
        self._control("delete_subshell_request", {"subshell_id": self.subshell})


state0 = RankRow(-1, "", None, "unknown")  # what a rank not (yet) shown reads as


def ranks(state: PanelState, mesh: str = "procs") -> dict[int, RankRow]:
    m = next((m for m in state.meshes if m.name == mesh), None)
    return {} if m is None else {r.rank: r for r in m.rows}


@pytest.fixture
def panel(kc):
    p = Panel(kc)
    p.wait_state("the first state", lambda s: True)
    yield p
    p.close()


def test_the_panel_sees_ranks_live_and_an_idle_kernel_sends_nothing(kc, panel):
    out, reply = run(kc, "procs = %mesh spawn -n 4")
    assert reply["status"] == "ok", text(out)
    state = panel.wait_state("4 idle ranks", lambda s: len(ranks(s)) == 4 and not s.running)
    assert [r.state for r in ranks(state).values()] == ["idle"] * 4
    assert all(r.pid and r.rss_mib for r in ranks(state).values())

    before = panel.wait_quiet()  # the last update of the spawn has gone out
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # then 3 s of an idle kernel: nothing at all
        panel.io.pump(0.1)
    assert len(panel.messages()) == before, "an idle kernel sent the panel updates"

    msg_id = kc.execute("%%mesh\nimport time\nfor i in range(6):\n    print('step', i, flush=True)\n"
                        "    time.sleep(0.4)")
    t0 = time.monotonic()
    panel.wait_state("every rank busy", lambda s: all(r.state == "busy" for r in ranks(s).values())
                     and len(ranks(s)) == 4, timeout=10)
    panel.wait_state("a rank's last line", lambda s: ranks(s).get(0, state0).last.startswith("step"), timeout=10)
    panel.io.wait_idle(msg_id, 30)
    sent = len(panel.messages()) - before
    assert sent <= 2 * (time.monotonic() - t0) + 2, f"{sent} updates in {time.monotonic() - t0:.1f} s"
    panel.wait_state("the ranks idle again", lambda s: not s.running and ranks(s).get(3, state0).state == "idle",
                     timeout=10)

    panel.send("log", mesh="procs")  # answered with the lines, not a reply
    lines = panel.io.wait("the log", lambda: next((d for d in panel.messages() if d.get("type") == "log"), None), 10)
    assert [line[3] for line in lines["lines"] if line[1] == 2] == [f"step {i}" for i in range(6)]


def test_the_panels_requests_leave_the_notebooks_busy_state_alone(kc, panel):
    """JupyterLab shows as the notebook's state the last status message on IOPub, whatever
    request it belongs to.  The panel's requests, on its subshell while a cell runs, publish
    no busy/idle (their "idle" read as the notebook's: "Idle" through a whole cell), so the
    cell's "busy" is the last status until its "idle"; other requests keep their pair."""
    run(kc, "procs = %mesh spawn -n 2")
    msg_id = kc.execute("%%mesh\nimport time\ntime.sleep(3)")
    panel.wait_state("the cell running", lambda s: s.running, timeout=10)
    before = len(panel.messages())
    for _ in range(3):  # what an open panel sends during a cell: its history polls, the log, a refresh
        panel.send("metrics", mesh="procs")
    panel.send("log", mesh="procs")
    panel.send("refresh")
    reply = panel.request("stacks", mesh="procs", timeout=30)  # and a button
    assert reply.ok, reply.message
    panel.io.wait("the answers", lambda: sum(d.get("type") in ("metrics", "log")
                                             for d in panel.messages()[before:]) == 4, 10)
    assert not panel.io.idle(msg_id), "the cell ended before the panel's requests were answered"
    panel.io.wait_idle(msg_id, 30)
    statuses = [m for m in panel.io.messages if m.msg_type == "status"]
    assert [m.content["execution_state"] for m in statuses if m.parent_id in panel.msg_ids] == []
    start = next(i for i, m in enumerate(statuses) if m.parent_id == msg_id)
    during = [(m.content["execution_state"], m.parent_id) for m in statuses[start:]]
    assert during == [("busy", msg_id), ("idle", msg_id)], during

    # A comm message to another comm, and any other request, still say busy, then idle.
    others = [panel.send_shell("comm_msg", {"comm_id": "not-the-panels", "data": {}}),
              panel.send_shell("kernel_info_request", {})]
    panel.io.wait("their idle", lambda: all(panel.io.idle(m) for m in others), 10)
    said = [[s.content["execution_state"] for s in panel.io.of(m, "status")] for m in others]
    assert said == [["busy", "idle"]] * 2, said


def test_dead_rank_restart_interrupt_and_spawn_from_the_panel(kc, panel):
    run(kc, "procs = %mesh spawn -n 3")
    panel.wait_state("3 ranks", lambda s: len(ranks(s)) == 3)
    out, _reply = run(kc, "%%mesh --ranks 2\nimport os\nos._exit(3)")
    t0 = time.monotonic()
    state = panel.wait_state("rank 2 dead", lambda s: ranks(s).get(2, state0).state == "dead", timeout=2)
    assert time.monotonic() - t0 < 2 and "3" in ranks(state)[2].detail, ranks(state)[2]

    reply = panel.request("restart", mesh="procs", rank=2)
    assert reply.ok, reply.message
    assert reply.message == "restarted rank 2 of procs with fresh namespaces"
    panel.wait_state("rank 2 alive", lambda s: ranks(s).get(2, state0).state == "idle", timeout=5)
    assert "[ranks 0-2] 1" in text(run(kc, "%%mesh\n1").outputs)

    # The interrupt button while a cell runs: its request goes over the panel's subshell.
    msg_id = kc.execute("%%mesh\nimport time\nprint('sleeping', flush=True)\ntime.sleep(4)\nprint('slept')")
    panel.wait_state("rank 1 busy", lambda s: ranks(s).get(1, state0).state == "busy", timeout=5)
    # The button is pressed once rank 1 is seen in its cell (as a user sees it): busy comes as the
    # call arrives, and an interrupt that lands before the cell's code runs is dropped (fresh33).
    panel.io.wait("rank 1 in its sleep", lambda: 1 in said_by(
        "\n".join(line.rstrip() for line in text(panel.io.outputs(msg_id)).splitlines()), "sleeping"), 30,
        detail=panel.io.so_far(msg_id))
    reply = panel.request("interrupt", mesh="procs", rank=1, timeout=10)
    assert reply.ok and reply.message == "interrupted rank 1 of procs", reply
    outputs = panel.io.wait_idle(msg_id, 30)
    got = text(outputs)
    assert "[rank 1] KeyboardInterrupt: interrupted at cell line 4: time.sleep(4)" in got.splitlines(), got
    shown = "\n".join(line.rstrip() for line in got.splitlines())  # (the blanked progress line's spaces)
    assert said_by(shown, "slept") == [0, 2] and "Traceback" not in got, got  # collapsed, or not on a loaded machine

    reply = panel.request("spawn", n=2, name="side")
    assert reply.ok and reply.message.startswith("side: 2 ranks"), reply
    state = panel.wait_state("the new mesh", lambda s: len(ranks(s, "side")) == 2)
    assert [m.name for m in state.meshes if m.current] == ["procs"]  # the notebook's mesh stays current
    assert "side" in text(run(kc, "print(side.name)").outputs)
    reply = panel.request("stop", mesh="side")
    assert reply.ok, reply
    panel.wait_state("side gone", lambda s: not ranks(s, "side"))
    bad = panel.request("restart", mesh="nope")
    assert not bad.ok and "no mesh named 'nope'" in bad.message


def test_a_restart_by_the_policy_shows_in_the_panel_and_its_log(kc, panel):
    run(kc, "procs = %mesh spawn -n 2 --restart on-failure")
    state = panel.wait_state("2 ranks", lambda s: len(ranks(s)) == 2 and all(r.pid for r in ranks(s).values()))
    pid = ranks(state)[1].pid
    os.kill(pid, signal.SIGKILL)
    panel.wait_state("rank 1 replaced", lambda s: ranks(s).get(1, state0).state == "idle"
                     and ranks(s)[1].pid not in (None, pid), timeout=30)

    def event_lines():  # asked again each time: the line comes just after the rank is up
        panel.send("log", mesh="procs")
        panel.io.pump(0.3)
        return next((d for d in panel.messages() if d.get("type") == "log"
                     and any(line[2] == "event" for line in d["lines"])), None)

    log = panel.io.wait("an event line in the log", event_lines, 15)
    events = [line for line in LogLines.decode(log).lines if line[2] == "event"]
    assert len(events) == 1 and events[0][1] == 1, events
    assert events[0][3].startswith("[procs] rank 1 was killed by signal 9 (SIGKILL): restarted in "), events


def test_a_mesh_from_the_panel_is_announced_and_current_only_when_asked(kc, panel):
    """The New mesh dialog never moves the notebook's cells to another mesh behind its back:
    its mesh is current only when the dialog asks (``use``), and the next cell says what the
    panel started; a name in use is refused, not replaced."""
    run(kc, "procs = %mesh spawn -n 1")
    reply = panel.request("spawn", n=1)
    assert reply.ok, reply
    assert reply.message == ("procs1: 1 rank (%mesh spawn -n 1 --name procs1); procs stays current "
                             "(%mesh use procs1, or Use in the panel, makes it current)"), reply
    out, _reply = run(kc, "%%mesh\nimport os\nos.getpid() > 0")
    assert text(out).splitlines() == [
        "%mesh: the Mesh panel spawned mesh procs1: 1 rank (%mesh spawn -n 1 --name procs1); the variable procs1 "
        "holds it; procs stays current (%mesh use procs1, or Use in the panel, makes it current)",
        "[rank 0] True"], text(out)
    assert text(run(kc, "print(1)").outputs) == "1\n"  # said once
    assert "* procs: 1 rank" in text(run(kc, "%mesh list").outputs)

    reply = panel.request("spawn", n=1, name="side", use=True)
    assert reply.ok and reply.message.endswith("it is the current mesh: %%mesh cells run on it"), reply
    listed = text(run(kc, "%mesh list").outputs)
    assert listed.startswith("%mesh: the Mesh panel spawned mesh side: 1 rank") and "\n* side: 1 rank" in listed, listed
    bad = panel.request("spawn", n=2, name="side")
    assert not bad.ok and bad.message == "a mesh named 'side' exists: stop it first, or pick another name", bad


def test_the_stacks_button_works_while_a_cell_runs(kc, panel):
    run(kc, "procs = %mesh spawn -n 3")
    msg_id = kc.execute("%%mesh\nimport time\ndef wait_for_data():\n    time.sleep(1 if __import__('monarch_kernel')"
                        ".current_rank().rank != 1 else 30)\nwait_for_data()")
    panel.wait_state("the cell running", lambda s: s.running and ranks(s).get(1, state0).state == "busy", timeout=10)
    deadline = time.monotonic() + 20
    while True:  # ranks 0 and 2 finish their second first; rank 1 waits on
        reply = panel.request("stacks", mesh="procs", timeout=30)
        assert reply.ok, reply.message
        if "rank 1 differs from the rest" in reply.message or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert reply.message == "stacks of procs: 2 groups, rank 1 differs from the rest", reply
    assert "[rank 1] wait_for_data (" in reply.report and "[ranks 0,2] idle" in reply.report, reply.report
    one = panel.request("stacks", mesh="procs", rank=1)
    assert one.ok and one.report.startswith("Stacks of mesh 'procs': 1 rank in 1 group"), one
    bad = panel.request("stacks", mesh="procs", rank=7)
    assert not bad.ok and "not in this mesh of 3 ranks" in bad.message, bad
    panel.request("interrupt", mesh="procs", rank=1)
    panel.io.wait_idle(msg_id, 30)


def test_the_watchdog_shows_the_stacks_once_and_the_panel_marks_the_odd_rank(kc, panel):
    run(kc, "procs = %mesh spawn -n 3")
    out, reply = run(kc, "%mesh watchdog 3")
    assert "watchdog on: a cell that waits on ranks for 3 s shows their stacks" in text(out)
    out, reply = run(kc, "%mesh watchdog soon")
    assert reply["ename"] == "UsageError" and "type  %mesh watchdog 60" in reply["evalue"]
    msg_id = kc.execute("%%mesh\nimport time\nfrom monarch_kernel import current_rank\ndef slow_io():\n"
                        "    time.sleep(60)\nif current_rank().rank == 1:\n    slow_io()")
    state = panel.wait_state("rank 1 marked", lambda s: ranks(s).get(1, state0).stack_differs, timeout=30)
    assert [r.stack_differs for r in ranks(state).values()] == [False, True, False]
    panel.request("interrupt", mesh="procs", rank=1)
    got = text(panel.io.wait_idle(msg_id, 30))
    assert got.count("%mesh watchdog: the cell has waited on procs for 3 s") == 1, got
    assert "[rank 1] slow_io (" in got and "[ranks 0,2] idle" in got, got
    panel.wait_state("the mark gone with the cell", lambda s: not s.running and not any(
        r.stack_differs for r in ranks(s).values()), timeout=10)
    run(kc, "%mesh watchdog off")


def test_the_panel_polls_metrics_gets_each_ranks_history_and_counts_tensors(kc, panel):
    run(kc, "procs = %mesh spawn -n 2")
    before = len(panel.messages())
    for _ in range(3):
        panel.send("metrics", mesh="procs")
    got = panel.io.wait("three metrics answers", lambda: (lambda m: m if len(m) >= 3 else None)(
        [d for d in panel.messages()[before:] if d.get("type") == "metrics"]), 30)
    last = Metrics.decode(got[-1])
    assert last.mesh == "procs" and sorted(last.ranks) == ["0", "1"]
    assert len(last.ranks["0"]["cpu"]) == 3 and last.ranks["0"]["cpu"][0] is None  # no rate from one sample
    assert all(isinstance(v, float) and v > 10 for v in last.ranks["1"]["rss_mib"]), last.ranks["1"]

    # The mesh's distributed tensors: their count and bytes per rank, as %mesh tensors has them.
    out, reply = run(kc, "import torch\nwith procs.activate():\n    t = torch.zeros(16, 4)\n    u = torch.ones(3)",
                     timeout=120)
    assert reply["status"] == "ok", text(out)
    state = panel.wait_state("two tensors counted", lambda s: getattr(mesh_of(s), "tensors", 0) == 2)
    assert mesh_of(state).tensor_bytes == 16 * 4 * 4 + 3 * 4
    run(kc, "del t")
    state = panel.wait_state("one tensor left", lambda s: getattr(mesh_of(s), "tensors", 0) == 1)
    assert mesh_of(state).tensor_bytes == 12


def test_the_panels_restart_kills_and_replaces_a_rank_that_stopped_responding(kc, panel):
    """The one restart path (``ProcMesh.restart``): the panel's button, like ``%mesh restart``,
    SIGKILLs a rank that stopped answering heartbeats (here SIGSTOPped) and starts it afresh."""
    import os
    import signal

    run(kc, "%env MONARCH_KERNEL_HEARTBEAT_TIMEOUT=1.5")
    run(kc, "procs = %mesh spawn -n 2")
    out, _reply = run(kc, "%%mesh\nimport os\nos.getpid()")
    pids = {int(line.split()[1].rstrip("]")): int(line.split()[-1])
            for line in text(out).splitlines() if line.startswith("[rank ")}
    freeze(pids[1])
    try:
        deadline = time.monotonic() + 20
        while True:  # an idle kernel sends no state of its own accord: ask, as the panel's refresh does
            seen = len(panel.states())
            panel.send("refresh")
            state = panel.wait_state("a refreshed state", lambda s: True, after=seen)
            if ranks(state).get(1, state0).state == "not responding":
                break
            assert time.monotonic() < deadline, f"rank 1 never shown not responding: {ranks(state)}"
            time.sleep(0.5)
        reply = panel.request("restart", mesh="procs", rank=1)
        assert reply.ok, reply.message
        assert reply.message == "restarted rank 1 of procs with fresh namespaces (rank 1 not responding: killed first)"
        panel.wait_state("rank 1 idle again", lambda s: ranks(s).get(1, state0).state == "idle", timeout=10)
        out, _reply = run(kc, "%%mesh\nimport os\nos.getpid()")
        now = {int(line.split()[1].rstrip("]")): int(line.split()[-1])
               for line in text(out).splitlines() if line.startswith("[rank ")}
        assert now[0] == pids[0] and now[1] != pids[1], (pids, now)
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass


GRID_CELL = ("%%mesh\nfrom IPython.display import display, HTML\nfrom monarch_kernel import current_rank\n"
             "display(HTML(f'<b>rank {current_rank().rank}</b>'))")


def test_rich_output_of_several_ranks_is_one_grid_only_with_a_panel(kc):
    run(kc, "procs = %mesh spawn -n 2")
    plain = run(kc, GRID_CELL).outputs
    assert [o.text for o in plain if o.kind == "stream"] == ["[rank 0]\n", "[rank 1]\n"]  # today's text
    assert not any(GRID_MIME in o.data for o in plain)
    p = Panel(kc)
    try:
        p.wait_state("the first state", lambda s: True)
        grid = [o for o in run(kc, GRID_CELL).outputs if o.kind == "display_data"]
        assert len(grid) == 1 and GRID_MIME in grid[0].data, grid
        items = grid[0].data[GRID_MIME]["items"]
        assert [(i["rank"], i["data"]["text/html"]) for i in items] == [(0, "<b>rank 0</b>"), (1, "<b>rank 1</b>")]
    finally:
        p.close()


def mesh_of(state: PanelState, name: str = "procs") -> MeshRow | None:
    return next((m for m in state.meshes if m.name == name), None)


def test_a_large_mesh_is_summarised_and_its_full_table_comes_on_demand(kc, panel):
    """Over status.SUMMARY_OVER ranks a state carries counts by state and the ranks that are
    not idle only; the "show all ranks" toggle's request gets every row until it is undone."""
    n = 48
    out, reply = run(kc, f"procs = %mesh spawn -n {n}", timeout=60)
    assert reply["status"] == "ok", text(out)
    state = panel.wait_state(f"{n} idle ranks", lambda s: (m := mesh_of(s)) is not None and not s.running
                             and m.counts == {"idle": n}, timeout=10)
    mesh = mesh_of(state)
    assert mesh is not None and mesh.summary and not mesh.expanded and mesh.rows == [] and mesh.ranks == n, mesh
    assert len(json.dumps(state.encode())) < 1000  # not 48 rows

    run(kc, "%%mesh --ranks 7\nimport os\nos._exit(3)")
    state = panel.wait_state("rank 7 dead", lambda s: (m := mesh_of(s)) is not None and m.dead == 1, timeout=5)
    mesh = mesh_of(state)
    assert mesh is not None and mesh.counts == {"idle": n - 1, "dead": 1}, mesh.counts
    assert [(r.rank, r.state) for r in mesh.rows] == [(7, "dead")] and "3" in mesh.rows[0].detail, mesh.rows

    run(kc, "feed = get_ipython().magics_manager.registry['MeshMagics'].session.panel\nfeed.view.cpu.clear()")
    msg_id = kc.execute("%%mesh --ranks 0-2\nimport time\ntime.sleep(3)")
    state = panel.wait_state("ranks 0-2 busy", lambda s: (m := mesh_of(s)) is not None
                             and m.counts.get("busy") == 3, timeout=5)
    mesh = mesh_of(state)
    assert mesh is not None and [(r.rank, r.state) for r in mesh.rows] == [(0, "busy"), (1, "busy"), (2, "busy"),
                                                                           (7, "dead")], mesh.rows
    assert all(r.rss_mib for r in mesh.rows[:3]), mesh.rows  # the rows sent are measured
    panel.io.wait_idle(msg_id, 30)
    code = "print(sorted(feed.view.cpu) == sorted(r['pid'] for r in procs.rank_states()[:3]))"
    measured = text(run(kc, code).outputs)
    assert measured == "True\n", measured  # and only they: not the 44 idle ranks

    seen = len(panel.states())
    reply = panel.request("table", mesh="procs", full=True)
    assert reply.ok and reply.message == f"every rank of procs is listed ({n} rows)", reply
    state = panel.wait_state("every row", lambda s: (m := mesh_of(s)) is not None and len(m.rows) == n
                             and m.counts.get("busy") is None, timeout=5, after=seen)
    mesh = mesh_of(state)
    assert mesh is not None and mesh.expanded and not mesh.summary, mesh
    assert [r.rank for r in mesh.rows] == list(range(n))
    assert mesh.rows[7].state == "dead" and all(r.state == "idle" and r.pid and r.rss_mib
                                                 for r in mesh.rows if r.rank != 7), mesh.rows

    seen = len(panel.states())
    reply = panel.request("table", mesh="procs", full=False)
    assert reply.ok, reply
    state = panel.wait_state("the summary again", lambda s: (m := mesh_of(s)) is not None and m.summary, timeout=5,
                             after=seen)
    mesh = mesh_of(state)
    assert mesh is not None and [r.rank for r in mesh.rows] == [7] and not mesh.expanded, mesh


def test_an_interrupt_from_the_panel_is_said_in_the_running_cell_when_it_happens(kc, panel):
    run(kc, "procs = %mesh spawn -n 3")
    msg_id = kc.execute("%%mesh\nimport time\ntime.sleep(8)\nprint('slept')")
    panel.wait_state("rank 2 busy", lambda s: ranks(s).get(2, state0).state == "busy", timeout=10)
    reply = panel.request("interrupt", mesh="procs", rank=2, timeout=10)
    assert reply.ok, reply
    said = panel.io.wait_output(msg_id, "interrupted from the Mesh panel", timeout=5)
    assert not panel.io.idle(msg_id), "the interrupt was said only when the cell ended"
    assert said.text == "[rank 2] interrupted from the Mesh panel\n", said.text
    got = text(panel.io.wait_idle(msg_id, 30))
    assert "[ranks 0-1] slept" in got and got.count("interrupted from the Mesh panel") == 1, got


def test_new_mesh_from_the_panel_is_told_to_the_notebook_and_leaves_the_current_mesh(kc, panel):
    """The dialog's mesh does not take the notebook's ``%%mesh`` cells unasked: the current
    mesh stays, and the next cell's output begins by saying what the panel made."""
    run(kc, "procs = %mesh spawn -n 2")
    reply = panel.request("spawn", n=3, name="side")
    assert reply.ok, reply
    assert reply.message == ("side: 3 ranks (%mesh spawn -n 3 --name side); procs stays current "
                             "(%mesh use side, or Use in the panel, makes it current)"), reply.message
    panel.wait_state("side listed, procs current", lambda s: len(ranks(s, "side")) == 3
                     and [m.name for m in s.meshes if m.current] == ["procs"])
    cells = panel.states()[-1].cell  # cells begun: each state says how many (a note goes with the next)
    out = run(kc, "%%mesh\nprint('here')").text.splitlines()
    panel.wait_state("the cell counted", lambda s: s.cell == cells + 1)
    assert out == ["%mesh: the Mesh panel spawned mesh side: 3 ranks (%mesh spawn -n 3 --name side); the "
                   "variable side holds it; procs stays current (%mesh use side, or Use in the panel, makes it "
                   "current)", "[ranks 0-1] here"], out
    assert run(kc, "%%mesh\nprint('again')").text.splitlines() == ["[ranks 0-1] again"]  # said once

    # Use, from the panel: now the notebook's cells run on side, and the next cell says so.
    assert panel.request("use", mesh="side").ok
    out = run(kc, "%%mesh\nprint('there')").text.splitlines()
    assert out == ["%mesh: side made current from the Mesh panel: %%mesh cells run on its 3 ranks",
                   "[ranks 0-2] there"], out

    # While a cell runs, the panel's mesh is told in that cell, at once.
    msg_id = kc.execute("import time\ntime.sleep(6)")
    panel.wait_state("the cell running", lambda s: s.running, timeout=10)
    assert panel.request("spawn", n=1, name="third").ok
    said = panel.io.wait_output(msg_id, "spawned mesh third", timeout=5)
    assert not panel.io.idle(msg_id) and said.text.startswith("%mesh: the Mesh panel spawned mesh third: 1 rank ")
    panel.io.wait_idle(msg_id, 30)
    for name in ("third", "side"):
        assert panel.request("stop", mesh=name).ok
    out = run(kc, "1").text.splitlines()
    assert out == ["%mesh: mesh third stopped from the Mesh panel; side is the current mesh",
                   "%mesh: mesh side stopped from the Mesh panel; procs is the current mesh", "1"], out
