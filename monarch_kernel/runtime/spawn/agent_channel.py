"""The framing between a controller and the agent on each of its hosts: ``Kind.HOST``
messages whose one part is one ``host_messages`` message, signed like every message and never
unpickled; the link's timing; and the credentials line an agent reads on its stdin.  Both
sides import it (``agent_link`` in the controller, ``monarch_kernel.agent`` on the host); it
never holds either side's state.
"""

from __future__ import annotations

import json

from .. import config
from ..wire.curve import CurveKeys
from ..wire.envelope import Header, Kind, Part, Status, join_parts, split_parts
from .host_messages import MalformedMessage, Message
from .host_messages import decode as decode_message

BEAT_S = config.seconds("agent_beat")
# A side that hears nothing from the other for this long declares it gone; checked every
# beat, so a dead host is declared within SILENT_S + BEAT_S = 3 s.
SILENT_S = config.seconds("agent_silent")
# What an agent says on its stderr, before it exits, when its host has no route to the
# controller's address (a job may then start it again through its ssh connection).
NO_ROUTE = "monarch_kernel.agent: this host has no route to the controller at"
# ... and when it has one, but nothing came back from the controller there (a firewall, an
# address of another network, a port nothing forwards).
NEVER_HEARD = "monarch_kernel.agent: nothing came back from the controller at"
UNREACHED = (NO_ROUTE, NEVER_HEARD)
# What an agent prints on its stdout once it starts up and dials the controller: a launcher
# that reads it (ssh) times ``reach_timeout`` from there, not from a start that a busy or
# cold host may take seconds over (python, imports).
DIALING = "mk-agent-dialing"


def encode(host_id: str, origin: str, msg: Message) -> tuple[Header, list]:
    h = Header.control(Kind.HOST, origin, host_id)
    return h, join_parts(h, [Part(0, Status.OK, [msg.encode()])])


def decode(h: Header, body: list) -> Message | None:
    """The message of an authenticated HOST message (None if it is not one)."""
    parts = split_parts(h, body)
    if len(parts) != 1 or len(parts[0].frames) != 1:
        return None
    try:
        return decode_message(bytes(parts[0].frames[0]))
    except MalformedMessage:
        return None


def credentials(host_id: str, key: bytes, curve: CurveKeys, controller: str, bind: str | None,
                warm: tuple = ()) -> bytes:
    """The one line an agent reads on its stdin: everything secret it needs, never on argv,
    in the environment or in a log (and the modules its template imports before forking)."""
    return json.dumps({
        "host": host_id, "key": key.hex(), "curve": [k.decode() for k in curve.to_wire()],
        "controller": controller, "bind": bind, "warm": list(warm),
    }).encode() + b"\n"


def read_credentials(line: bytes) -> dict:
    d = json.loads(line)
    d["key"] = bytes.fromhex(d["key"])
    d["curve"] = CurveKeys.from_wire([k.encode() for k in d["curve"]])
    return d
