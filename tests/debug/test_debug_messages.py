"""The debugger's and distributed pdb's wire messages (``monarch_kernel.debug.messages``):
each class encodes to a fixed schema of plain JSON values and decodes back to an equal
message, through JSON and through the runtime's wire codec.  Fast; no processes."""

from __future__ import annotations

import json

import pytest

from monarch_kernel.actor.port import Port
from monarch_kernel.debug import messages as m
from monarch_kernel.runtime.wire.envelope import Part
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(30)

OPTIONAL = type(None)

# Every field of the encoded form, and the JSON types it may hold.
SCHEMAS = {
    m.Stopped: {"kind": str, "mesh": str, "rank": int, "session": int, "filename": str, "lineno": int,
                "function": str, "reason": str, "cell": bool, "error": str, "missing": list,
                "reply": (list, OPTIONAL)},
    m.Prompt: {"kind": str, "mesh": str, "rank": int, "session": int, "output": str, "lineno": int,
               "filename": str},
    m.Resumed: {"kind": str, "mesh": str, "rank": int, "session": int, "output": str, "stepping": bool},
    m.Ended: {"kind": str, "mesh": str, "rank": int, "session": int, "output": str},
    m.Reply: {"kind": str, "line": (str, OPTIONAL), "sources": dict},
    m.DapRequest: {"seq": int, "type": str, "command": str, "arguments": dict},
    m.DapResponse: {"type": str, "seq": int, "request_seq": int, "success": bool, "command": str,
                    "body": dict, "message": str},
    m.DapEvent: {"seq": int, "type": str, "event": str, "body": dict},
    m.DapFrames: {"kind": str, "link": int, "messages": list},
    m.DapClosed: {"kind": str, "link": int, "reason": str},
    m.RankHost: {"kind": str, "hostname": str, "host_key": str, "addresses": list},
}

EXAMPLES = [
    m.Stopped("procs", 3, 1, "/tmp/ipykernel/cell.py", 4, "<module>", "breakpoint", True, "", ("/x.py", "/y.py"),
              Port("ipc:///tmp/mk-1/r.3", 7, 3)),
    m.Stopped("procs", 0, 2, "/a.py", 9, "f", "post-mortem", False, "ZeroDivisionError: division by zero"),
    m.Prompt("procs", 3, 1, "> /tmp/cell.py(4)<module>()\n-> y = x + 1\n", 4, "/tmp/cell.py"),
    m.Resumed("procs", 3, 1, "42\n", True),
    m.Ended("procs", 3, 1, "bye\n"),
    m.Reply("p x"),
    m.Reply(None, {"/tmp/cell.py": "x = 1\nbreakpoint()\n"}),
    m.Reply(m.RELEASE),
    m.DapRequest(5, "setBreakpoints", {"source": {"path": "/tmp/c.py"}, "breakpoints": [{"line": 4}]}),
    m.DapRequest(6, "configurationDone"),
    m.DapResponse(5, "setBreakpoints", True, {"breakpoints": [{"verified": True, "line": 4}]}, seq=12),
    m.DapResponse(7, "evaluate", False, message="rank 1 of mesh 'procs': not connected"),
    m.DapEvent("stopped", {"reason": "breakpoint", "threadId": 1}, seq=13),
    m.DapEvent("initialized"),
    m.DapFrames(3, [m.DapEvent("stopped", {"reason": "step", "threadId": 1}, seq=14).encode(),
                    m.DapResponse(9, "next", True, seq=15).encode()]),
    m.DapClosed(3, "debugpy closed the connection"),
    m.RankHost("gpu-node-7", "5f0c.../4026531840", ("10.1.2.3", "127.0.0.1")),
]


def same(a, b) -> bool:
    """Equal messages; a Stopped's reply port is compared by where it points."""
    if isinstance(a, m.Stopped) and isinstance(b, m.Stopped):
        ports = [(p.address, p.port_id, p.rank) if p is not None else None for p in (a.reply, b.reply)]
        return ports[0] == ports[1] and {**vars(a), "reply": None} == {**vars(b), "reply": None}
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_each_message_encodes_to_its_schema_and_back(msg):
    wire = msg.encode()
    schema = SCHEMAS[type(msg)]
    optional = {k for k, t in schema.items() if k in ("arguments", "body", "message")}
    assert set(schema) - optional <= set(wire) <= set(schema), (sorted(wire), sorted(schema))
    for key, value in wire.items():
        assert isinstance(value, schema[key]), f"{type(msg).__name__}.{key} is {value!r}"
    assert wire.get("kind", wire.get("type")) == msg.KIND
    through_json = json.loads(json.dumps(wire))
    assert through_json == wire  # plain JSON values only: no tuples, no objects
    assert same(type(msg).decode(through_json), msg)
    through_codec = Part(0, 0, dumps(wire)).load()
    assert same(type(msg).decode(through_codec), msg)


@pytest.mark.parametrize("msg", [x for x in EXAMPLES if type(x) in m.RANK_MESSAGES.values()],
                         ids=lambda msg: type(msg).__name__)
def test_the_hub_decodes_what_a_rank_sends_by_its_kind(msg):
    assert same(m.decode(msg.encode()), msg)


def test_a_malformed_pdb_message_says_what_is_wrong():
    wire = m.Prompt("procs", 1, 1, "").encode()
    del wire["session"]
    wire["colour"] = "red"
    with pytest.raises(ValueError, match=r"missing \['session'\], unexpected \['colour'\]"):
        m.Prompt.decode(wire)
    with pytest.raises(ValueError, match="expected a 'pdb.ended' message, got 'pdb.prompt'"):
        m.Ended.decode(m.Prompt("procs", 1, 1, "").encode())
    with pytest.raises(ValueError, match="not a pdb message from a rank"):
        m.decode(m.Reply("c").encode())  # the kernel's answer, not a rank's message
    with pytest.raises(ValueError, match="not a pdb message from a rank"):
        m.decode(("c", {}))


def test_dap_decoding_tolerates_what_the_spec_leaves_optional():
    assert m.decode_dap({"type": "response", "request_seq": 3, "command": "next", "success": True,
                         "seq": 9, "extra": 1}) == m.DapResponse(3, "next", True, seq=9)
    assert m.decode_dap({"type": "event", "event": "output"}) == m.DapEvent("output")
    assert m.decode_dap({"type": "reverse-something"}) is None
    assert m.decode_dap(["not", "a", "message"]) is None


def test_the_kernel_decodes_what_a_relay_sends_by_its_kind():
    for msg in (m.DapFrames(1, []), m.DapClosed(1, "gone")):
        assert same(m.decode_tunnel(msg.encode()), msg)
    with pytest.raises(ValueError, match="not a DAP tunnel message from a rank"):
        m.decode_tunnel(m.Reply("c").encode())
    with pytest.raises(ValueError, match=r"missing \['reason'\]"):
        m.DapClosed.decode({"kind": "dap.closed", "link": 1})
