"""An attacker of a debug port: a DAP client in the standard library alone, run as another
user (``as_user``, say ``other_user.NOBODY``) or in another network namespace, that tries to
pause a thread named "spin" (``SPIN`` starts one on rank 1) and run code in it.  Shared by the
debugger's security tests and those of its forwarded ports."""

from __future__ import annotations

import json
import subprocess

from support.other_user import SYSTEM_PYTHON

# A DAP client in the standard library alone: argv[1] is a JSON list of targets (["tcp", host,
# port] or ["unix", path], "@name" for an abstract socket), argv[2] the file its evaluate
# writes, argv[3] (if given) a JSON object of more attach arguments (a launch.json entry's
# fields).  It prints, per target, what it got: EACCES, refused, closed (connected, then
# nothing but the end), silent (nothing within the deadline), answered (DAP replies, but no
# code ran), or ran (the evaluate succeeded).
ATTACK = r'''
import json, socket, sys, time

def frame(seq, command, arguments=None):
    body = json.dumps({"seq": seq, "type": "request", "command": command,
                       "arguments": arguments or {}}).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body

class Peer:
    def __init__(self, sock):
        self.sock, self.buf, self.got, self.ended = sock, b"", 0, False
    def next(self, deadline):
        while True:
            if b"\r\n\r\n" in self.buf:
                head, rest = self.buf.split(b"\r\n\r\n", 1)
                n = int(head.split(b":")[1])
                if len(rest) >= n:
                    self.buf = rest[n:]
                    return json.loads(rest[:n])
            left = deadline - time.monotonic()
            if left <= 0 or self.ended:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return None
            except OSError:
                data = b""
            if not data:
                self.ended = True
                return None
            self.got += len(data)
            self.buf += data
    def wait(self, want, deadline):
        while True:
            msg = self.next(deadline)
            if msg is None or want(msg):
                return msg
    def send(self, seq, command, arguments=None):
        try:
            self.sock.sendall(frame(seq, command, arguments))
        except OSError:
            self.ended = True

def response(seq):
    return lambda m: m.get("type") == "response" and m.get("request_seq") == seq

def attack(target, marker):
    if target[0] == "tcp":
        sock = socket.socket(socket.AF_INET6 if ":" in target[1] else socket.AF_INET)
        address = (target[1], target[2])
    else:
        sock = socket.socket(socket.AF_UNIX)
        address = "\0" + target[1][1:] if target[1].startswith("@") else target[1]
    sock.settimeout(5)
    try:
        sock.connect(address)
    except PermissionError:
        return "EACCES"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return "error: %s" % e
    peer, deadline = Peer(sock), time.monotonic() + 20
    peer.send(1, "initialize", {"adapterID": "python", "clientID": "attacker", "pathFormat": "path",
                                "linesStartAt1": True, "columnsStartAt1": True})
    peer.send(2, "attach", {"justMyCode": False, **attach_args})
    if peer.wait(lambda m: m.get("event") == "initialized", deadline) is None:
        return "closed" if peer.ended and not peer.got else ("silent" if not peer.got else "answered")
    peer.send(3, "configurationDone")
    peer.wait(response(2), deadline)
    peer.send(4, "threads")
    threads = (peer.wait(response(4), deadline) or {}).get("body", {}).get("threads", [])
    spin = [t["id"] for t in threads if t["name"] == "spin"]
    if not spin:
        return "answered"
    peer.send(5, "pause", {"threadId": spin[0]})
    stopped = peer.wait(lambda m: m.get("event") == "stopped", deadline)
    if stopped is None:
        return "answered"
    peer.send(6, "stackTrace", {"threadId": stopped["body"]["threadId"]})
    frames = (peer.wait(response(6), deadline) or {}).get("body", {}).get("stackFrames", [])
    if not frames:
        return "answered"
    code = "open(%r, 'w').write(__import__('os').popen('id').read())" % marker
    peer.send(7, "evaluate", {"expression": code, "frameId": frames[0]["id"], "context": "repl"})
    ran = peer.wait(response(7), deadline)
    peer.send(8, "disconnect", {"terminateDebuggee": False})  # lets the rank run on
    peer.wait(response(8), time.monotonic() + 5)
    return "ran" if ran and ran.get("success") else "answered"

targets, marker = json.loads(sys.argv[1]), sys.argv[2]
attach_args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
print(json.dumps([[t, attack(t, marker)] for t in targets]))
'''


def attack(targets, marker, as_user: list[str], netns: str | None = None, attach_args: dict | None = None) -> dict:
    command = [*as_user, SYSTEM_PYTHON, "-c", ATTACK, json.dumps(sorted(targets)), str(marker),
               json.dumps(attach_args or {})]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    return {tuple(t): got for t, got in json.loads(ran.stdout)}


SPIN = ("%%mesh --ranks 1\nimport threading, time\ndef _spin():\n    while True:\n        time.sleep(0.02)\n"
        "threading.Thread(target=_spin, name='spin', daemon=True).start()")
