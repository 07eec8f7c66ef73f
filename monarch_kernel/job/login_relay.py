"""The relay a ``SlurmJob(login=...)`` runs on the login node: compute nodes cannot reach the
controller, but they reach the login node, and the controller's ssh connection to it forwards
(``-R``) each controller port to a unix socket in a 0700 folder there.  This listens on the
login node's cluster-facing address, at the same port as the controller's, and joins each
connection to that socket.  It only moves bytes: Curve and the HMAC still authenticate both
ends, as for a controller the nodes reach directly.

It is the login ssh connection's own command (``python3 -c`` this file's text, with the most
connections it joins at once as its argument; standard library only, for whatever Python the
login node has).  One thread joins every connection (a ``selectors`` loop), so a flood of
connections costs no processes of the user's limit: past the most it holds, a connection is
closed as soon as it is accepted, and no error ends the loop.  It says ``mk-relay dir PATH``
first, then reads lines on its stdin: ``listen TARGET PORT`` (listen on this host's route
toward TARGET, a compute node) answers ``mk-relay listening IP PORT`` or ``mk-relay error PORT
WHY``.  At EOF (the controller or its ssh is gone) it removes its folder and exits.
"""

import os
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time

CHUNK = 1 << 16
HELD = 1 << 18  # bytes read from one side and not yet written to the other: reading it pauses past this


class _Pipe:
    """One direction of a joined connection: what ``src`` sent that ``dst`` has not taken yet."""

    def __init__(self, src, dst):
        self.src, self.dst = src, dst
        self.buf = bytearray()
        self.eof = False  # src said all it will
        self.done = False  # ... and dst was told (SHUT_WR)


class Relay:
    """The loop: listeners and joined connections, on one thread."""

    def __init__(self, most):
        self.most = most
        self.sel = selectors.DefaultSelector()
        self.joined = {}  # socket -> the pair of _Pipes it belongs to
        self.adds = []  # (listener, path) from the stdin thread
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))

    def add(self, listener, path):
        """(Any thread.) Serve ``listener``, joining its connections to the unix socket ``path``."""
        listener.setblocking(False)
        with self.lock:
            self.adds.append((listener, path))
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def run(self):
        while True:
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001  (no error ends the relay: say it, go on)
                sys.stderr.write(f"monarch_kernel relay: {type(e).__name__}: {e}\n")
                time.sleep(0.01)

    def _turn(self):
        for key, events in self.sel.select(1.0):
            kind, what = key.data
            if kind == "wake":
                self._woken()
            elif kind == "listen":
                self._accept(key.fileobj, what)
            else:
                self._move(key.fileobj, events)

    def _woken(self):
        try:
            self.wake_r.recv(4096)
        except OSError:
            pass
        with self.lock:
            adds, self.adds = self.adds, []
        for listener, path in adds:
            self.sel.register(listener, selectors.EVENT_READ, ("listen", path))

    def _accept(self, listener, path):
        for _ in range(64):  # a few at a time: the joined ones get their turn too
            try:
                conn, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, memory: a moment later, the next turn tries again
                time.sleep(0.05)
                return
            if len(self.joined) // 2 >= self.most:
                conn.close()  # past the most held at once
                continue
            out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                out.settimeout(1)
                out.connect(path)  # the ssh client's forward, on this host: it accepts at once
            except OSError:
                out.close()
                conn.close()
                continue
            conn.setblocking(False)
            out.setblocking(False)
            pair = (_Pipe(conn, out), _Pipe(out, conn))
            self.joined[conn] = self.joined[out] = pair
            self._watch(conn)
            self._watch(out)

    def _watch(self, sock):
        """Read ``sock`` while what it sent fits; write it while there is something for it."""
        pair = self.joined.get(sock)
        if pair is None:
            return
        reading = next(p for p in pair if p.src is sock)
        writing = next(p for p in pair if p.dst is sock)
        events = 0
        if not reading.eof and len(reading.buf) < HELD:
            events |= selectors.EVENT_READ
        if writing.buf:
            events |= selectors.EVENT_WRITE
        try:
            key = self.sel.get_key(sock)
        except KeyError:
            key = None
        if events and key is None:
            self.sel.register(sock, events, ("conn", None))
        elif events and key.events != events:
            self.sel.modify(sock, events, ("conn", None))
        elif not events and key is not None:
            self.sel.unregister(sock)

    def _move(self, sock, events):
        pair = self.joined.get(sock)
        if pair is None:
            return
        try:
            if events & selectors.EVENT_READ:
                pipe = next(p for p in pair if p.src is sock)
                data = sock.recv(CHUNK)
                if data:
                    pipe.buf += data
                else:
                    pipe.eof = True
            if events & selectors.EVENT_WRITE:
                pipe = next(p for p in pair if p.dst is sock)
                sent = sock.send(pipe.buf)
                del pipe.buf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(pair)
            return
        for pipe in pair:
            if pipe.eof and not pipe.buf and not pipe.done:
                pipe.done = True
                try:
                    pipe.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if all(p.done for p in pair):
            self._close(pair)
            return
        self._watch(pair[0].src)
        self._watch(pair[1].src)

    def _close(self, pair):
        for sock in (pair[0].src, pair[1].src):
            self.joined.pop(sock, None)
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()


def _route(target):
    ip = socket.getaddrinfo(target, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # sends nothing: picks the route
        return s.getsockname()[0]


def _say(*words):
    sys.stdout.write("mk-relay " + " ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def main():
    most = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 256
    folder = tempfile.mkdtemp(prefix="mk-relay-")  # 0700: only this user reaches the forwards in it
    relay = Relay(max(1, most))
    threading.Thread(target=relay.run, name="mk-relay", daemon=True).start()
    _say("dir", folder)
    try:
        for line in sys.stdin:
            words = line.split()
            if len(words) != 3 or words[0] != "listen" or not words[2].isdigit():
                continue
            port = int(words[2])
            try:
                ip = _route(words[1])
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((ip, port))
                listener.listen(128)
            except OSError as e:
                _say("error", port, f"{words[1]}: {e.strerror or e}")
                continue
            relay.add(listener, os.path.join(folder, str(port)))
            _say("listening", ip, port)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
