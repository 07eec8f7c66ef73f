"""The wire between a controller and the agent on each of its hosts: ``Kind.HOST`` messages
whose one part is a msgpack dict with an ``"op"`` key, signed like every message and never
unpickled.  Both sides import it (``agent_link`` in the controller, ``monarch_kernel.agent``
on the host); it holds op names, encoding and the credentials line, never either side's state.
"""

from __future__ import annotations

import json

import msgpack

from . import config
from .curve import CurveKeys
from .envelope import Header, Kind, Part, Status, join_parts, split_parts

# controller -> agent
RESERVE = "reserve"  # {tag, n}: reserve n TCP ports for ranks' inboxes -> PORTS
FORK = "fork"  # {tag, config: LaunchConfig.to_wire()} -> FORKED
KILL = "kill"  # {pid, signal}
BYE = "bye"  # end every rank and exit (job.kill())
# agent -> controller
UP = "up"  # {hostname, pid, ip, python, version}: the agent is serving
PORTS = "ports"  # {tag, ports}
FORKED = "forked"  # {tag, pid}
FORK_FAILED = "fork_failed"  # {tag, error}: a limit was reached there
EXIT = "exit"  # {pid, status}: a rank exited (status as os.waitpid gives it)
OUTPUT = "output"  # {items: [[pid, fd (1 or 2), data], ...]}: what ranks wrote, as their template read it
HELLO = "hello"  # {pid, hello}: a rank is up (its template's hello frame)
BEATS = "beats"  # {pids}: ranks that beat in the last second
# both ways, every BEAT_S: still here
BEAT = "beat"

BEAT_S = config.seconds("agent_beat")
# A side that hears nothing from the other for this long declares it gone; checked every
# beat, so a dead host is declared within SILENT_S + BEAT_S = 3 s.
SILENT_S = config.seconds("agent_silent")


def encode(host_id: str, origin: str, msg: dict) -> tuple[Header, list]:
    h = Header(Kind.HOST, 0, origin, origin, host_id)
    return h, join_parts(h, [Part(0, Status.OK, [msgpack.packb(msg, use_bin_type=True)])])


def decode(h: Header, body: list) -> dict | None:
    """The message of an authenticated HOST message (None if it is not one)."""
    parts = split_parts(h, body)
    if len(parts) != 1 or len(parts[0].frames) != 1:
        return None
    try:
        msg = msgpack.unpackb(bytes(parts[0].frames[0]), raw=False)
    except (ValueError, msgpack.ExtraData):
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("op"), str) else None


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
