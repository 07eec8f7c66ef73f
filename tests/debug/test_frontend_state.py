"""The kernel's debugger state without a rank: what the frontend set up (``FrontendState``),
the threads a rank target knows are stopped, and the answers it gives without asking the
rank.  Nothing connects: no debugpy, no kernel, no mesh."""

from __future__ import annotations

import pytest

from monarch_kernel.debug.controller.rank_target import FrontendState, RankTarget, response

pytestmark = pytest.mark.timeout(30)


def request(command: str, arguments: dict | None = None, seq: int = 1) -> dict:
    msg = {"type": "request", "seq": seq, "command": command}
    if arguments is not None:
        msg["arguments"] = arguments
    return msg


def bp_args(path: str, *lines: int) -> dict:
    return {"source": {"path": path}, "breakpoints": [{"line": n} for n in lines]}


def test_frontend_state_remembers_the_set_up_a_new_target_needs():
    state = FrontendState()
    assert (state.initialize, state.attach, state.exceptions, state.breakpoints, state.attached) == (
        None, None, None, {}, False)
    state.record(request("initialize", {"adapterID": "python"}))
    state.record(request("attach", {"justMyCode": False}))
    state.record(request("setExceptionBreakpoints", {"filters": ["raised"]}))
    state.record(request("setBreakpoints", bp_args("/tmp/a.py", 3)))
    state.record(request("setBreakpoints", bp_args("/tmp/b.py", 1, 2)))
    state.record(request("setBreakpoints", bp_args("/tmp/a.py", 5)))  # a file's newest set wins
    assert state.initialize == {"adapterID": "python"}
    assert state.attach == {"justMyCode": False} and state.attached
    assert state.exceptions == {"filters": ["raised"]}
    assert state.breakpoints == {"/tmp/a.py": bp_args("/tmp/a.py", 5), "/tmp/b.py": bp_args("/tmp/b.py", 1, 2)}


def test_frontend_state_keeps_copies_of_the_arguments():
    state = FrontendState()
    args = {"adapterID": "python"}
    state.record(request("initialize", args))
    args["adapterID"] = "changed later"
    assert state.initialize == {"adapterID": "python"}


def test_other_requests_change_nothing_and_missing_arguments_are_empty():
    state = FrontendState()
    for cmd in ("stackTrace", "continue", "configurationDone", "debugInfo", "dumpCell", "next"):
        state.record(request(cmd, {"threadId": 1}))
    assert state == FrontendState()
    state.record(request("initialize"))  # no "arguments" at all
    state.record({"command": "attach", "arguments": None})
    assert state.initialize == {} and state.attach == {} and state.attached


def test_disconnect_forgets_the_session_but_not_the_exception_filters():
    state = FrontendState()
    state.record(request("initialize", {"adapterID": "python"}))
    state.record(request("attach", {}))
    state.record(request("setExceptionBreakpoints", {"filters": ["uncaught"]}))
    state.record(request("setBreakpoints", bp_args("/tmp/a.py", 3)))
    state.record(request("disconnect", {"restart": False}))
    assert (state.initialize, state.attach, state.attached, state.breakpoints) == (None, None, False, {})
    assert state.exceptions == {"filters": ["uncaught"]}


def test_response_answers_the_request_it_was_given():
    assert response(request("debugInfo", seq=7), body={"isStarted": False}) == {
        "type": "response", "seq": 7, "request_seq": 7, "success": True, "command": "debugInfo",
        "body": {"isStarted": False}}
    assert response({"command": "next"}, False, message="not now") == {
        "type": "response", "seq": 0, "request_seq": 0, "success": False, "command": "next", "message": "not now"}


@pytest.fixture
def target():
    published: list[dict] = []
    t = RankTarget(None, "procs", 1, published.append)
    t.published = published
    return t


def event(name: str, **body) -> dict:
    return {"type": "event", "seq": 1, "event": name, "body": body}


def test_a_target_tracks_stopped_threads_from_debugpys_events(target):
    target._on_event(event("stopped", threadId=1, reason="breakpoint"))
    target._on_event(event("stopped", threadId=2, reason="step"))
    assert target.stopped_threads == {1, 2}
    target._on_event(event("continued", threadId=1, allThreadsContinued=False))
    assert target.stopped_threads == {2}
    target._on_event(event("stopped", threadId=1))
    target._on_event(event("continued", threadId=1))  # allThreadsContinued defaults to true
    assert target.stopped_threads == set()
    assert [m["event"] for m in target.published] == ["stopped", "stopped", "continued", "stopped", "continued"]


def test_only_the_current_target_reaches_the_frontend(target):
    target.current = False
    target._on_event(event("stopped", threadId=3))
    assert target.published == [] and target.stopped_threads == {3}
    target._on_event(event("initialized"))
    assert target._initialized.done()


def test_a_closed_connection_forgets_stops_and_attachment(target):
    target._on_event(event("stopped", threadId=1))
    target.attached = True
    target._on_close()
    assert (target.stopped_threads, target.attached, target.conn) == (set(), False, None)


def test_an_unconnected_target_says_how_to_go_on(target):
    reply = target.handle(request("stackTrace", {"threadId": 1}, seq=12), FrontendState())
    assert reply["success"] is False
    assert (reply["seq"], reply["request_seq"], reply["command"]) == (12, 12, "stackTrace")
    assert reply["message"].startswith("rank 1 of mesh 'procs': not connected")
    assert reply["message"].endswith(
        "Type  %mesh debug off  to debug the kernel again, or  %mesh debug 1  to reconnect.")


def test_what_a_target_answers_itself(target):
    done = target.handle(request("configurationDone", seq=4), FrontendState())
    assert (done["success"], done["seq"], done["command"]) == (True, 4, "configurationDone")
    target._on_event(event("stopped", threadId=5))
    target._on_event(event("stopped"))  # no threadId: not listed
    info = target.handle(request("debugInfo", seq=5), FrontendState())["body"]
    assert info["isStarted"] is False and info["stoppedThreads"] == [5] and info["breakpoints"] == []
    assert info["tmpFileSuffix"] == ".py" and info["hashMethod"] == "Murmur2"
    assert target.handle(request("inspectVariables"), FrontendState())["body"] == {"variables": []}
